"""Loading checkpoints (errors name the tensor) and fingerprinting model folders."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlayer.engine.loader import ModelLoadError, load_model, model_fingerprint
from kvlayer.engine.model_config import ModelConfigError
from kvlayer.engine.presets import init_model

Change = Callable[[dict[str, torch.Tensor]], object]


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def rewrite_weights(folder: Path, change: Change) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def test_loads_every_tensor_in_the_requested_dtype(tiny_model_dir: Path) -> None:
    saved = load_file(tiny_model_dir / "model.safetensors")
    model, cfg = load_model(tiny_model_dir, torch.float32, "cpu")
    state = model.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[name], saved[name]) for name in saved)
    assert cfg.model_name == "tiny-llama" and not model.training
    half, _ = load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rope_cos.dtype == torch.bfloat16


def test_tied_model_has_no_lm_head_and_ignores_a_saved_one(qwen2_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(qwen2_model_dir, tmp_path / "q")
    rewrite_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model, _ = load_model(folder, torch.float32, "cpu")
    assert model.lm_head is None


def test_rotary_inv_freq_buffers_are_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    rewrite_weights(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_model(folder, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight.*missing"),
        (lambda t: t.update({"model.norm.weight": torch.ones(65)}), "model.norm.weight.*shape"),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}), "unexpected.*q_proj.bias"),
        (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.ones(1)}), "model.layers.2"),
    ],
    ids=["missing", "wrong-shape", "unexpected", "extra-layer"],
)
def test_checkpoint_errors_name_the_tensor(
    tiny_model_dir: Path, tmp_path: Path, change: Change, message: str
) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    rewrite_weights(folder, change)
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder, torch.float32, "cpu")


def test_folder_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError):
        load_model(tmp_path / "absent", torch.float32, "cpu")
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(folder, torch.float32, "cpu")
    sharded = init_model("tiny", tmp_path / "s", shard_size=50_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim):
        load_model(sharded, torch.float32, "cpu")


def fingerprint_in_subprocess(folder: Path) -> str:
    code = "import sys; from kvlayer.engine.loader import model_fingerprint as f; print(f(sys.argv[1]))"
    result = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_fingerprint_is_stable_across_processes_and_copies(tiny_model_dir: Path, tmp_path: Path) -> None:
    here = model_fingerprint(tiny_model_dir)
    assert len(here) == 64 and int(here, 16) >= 0
    assert fingerprint_in_subprocess(tiny_model_dir) == here
    assert model_fingerprint(copy_model(tiny_model_dir, tmp_path / "copy")) == here


def test_fingerprint_tells_models_apart(tiny_model_dir: Path, tmp_path: Path) -> None:
    other_seed = init_model("tiny", tmp_path / "seed1", seed=1)
    assert model_fingerprint(other_seed) != model_fingerprint(tiny_model_dir)
    renamed = copy_model(tiny_model_dir, tmp_path / "cfg")
    raw = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 1e-5}))
    assert model_fingerprint(renamed) != model_fingerprint(tiny_model_dir)


def test_fingerprint_samples_huge_files_quickly(tmp_path: Path) -> None:
    """A sparse 8 GiB checkpoint: only the header and 16 x 64 KiB are read."""
    size = 8 << 30
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    (tmp_path / "config.json").write_text("{}")
    file = tmp_path / "model.safetensors"
    with file.open("wb") as stream:
        stream.write(struct.pack("<Q", len(header)) + header)
        stream.truncate(8 + len(header) + size)
    start = time.perf_counter()
    before = model_fingerprint(tmp_path)
    assert time.perf_counter() - start < 2.0
    with file.open("r+b") as stream:  # a byte inside the last sample window
        stream.seek(8 + len(header) + size - 100)
        stream.write(b"\x01")
    assert model_fingerprint(tmp_path) != before


@pytest.mark.parametrize("keep", [0.5, 100, 3], ids=["half", "header-cut", "length-cut"])
def test_a_truncated_checkpoint_names_the_file_and_says_it_is_corrupt(
    tiny_model_dir: Path, tmp_path: Path, keep: float
) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep) if keep < 1 else int(keep)])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors' is corrupt or truncated") as e:
        load_model(folder, torch.float32, "cpu")
    assert str(file) in str(e.value) and isinstance(e.value, ValueError)
    if keep >= 1:  # the header itself is cut: the fingerprint cannot be taken either
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            model_fingerprint(folder)
