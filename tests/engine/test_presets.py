"""Random model folders: deterministic by seed, the documented shapes, a byte tokenizer, usable outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvlayer.engine.attention_metadata import AttentionMetadata, NoHooks, PrefillSpan
from kvlayer.engine.loader import checkpoint_shapes, load_model
from kvlayer.engine.model_config import load_model_config, parse_model_config
from kvlayer.engine.presets import PRESETS, init_model, preset_config
from kvlayer.engine.tokenizer import Tokenizer


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(folder.iterdir())}


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    a = init_model("tiny", tmp_path / "a", seed=5)
    b = init_model("tiny", tmp_path / "b", seed=5)
    c = init_model("tiny", tmp_path / "c", seed=6)
    assert folder_bytes(a) == folder_bytes(b)
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(folder_bytes(a)) == files
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert all(not torch.equal(wa[name], wc[name]) for name in wa if not name.endswith("norm.weight"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_configs_parse(name: str) -> None:
    # only the config: writing bench's 500 MB of weights would be slow
    cfg = parse_model_config(preset_config(name))
    assert cfg.vocab_size >= 258 and cfg.num_heads % cfg.num_kv_heads == 0


def test_bench_preset_size_and_kv_bytes() -> None:
    cfg = parse_model_config(preset_config("bench"))
    params = sum(torch.Size(shape).numel() for shape in checkpoint_shapes(cfg).values())
    assert 115e6 < params < 135e6
    assert cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 == 24 * 1024
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings == 32768


def test_tiny_preset_writes_the_documented_config(tiny_model_dir: Path) -> None:
    cfg = load_model_config(tiny_model_dir)
    got = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
           cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings)  # fmt: skip
    assert got == (64, 2, 4, 2, 16, 128, 512, 4096)
    assert (cfg.architecture, cfg.torch_dtype) == ("llama", "float32")
    assert (cfg.eos_token_ids, cfg.bos_token_id) == ((257,), 256)


def test_architectures_and_options(qwen2_model_dir: Path, mistral_model_dir: Path, tmp_path: Path) -> None:
    qwen = load_model_config(qwen2_model_dir)
    assert (qwen.architecture, qwen.qkv_bias, qwen.tie_word_embeddings, qwen.sliding_window) == (
        "qwen2", True, True, None
    )
    assert "lm_head.weight" not in load_file(qwen2_model_dir / "model.safetensors")
    mistral = load_model_config(mistral_model_dir)
    assert (mistral.architecture, mistral.layer_windows, mistral.max_model_len) == ("mistral", (2048, 2048), 4096)
    windowed = init_model("tiny", tmp_path / "q", architecture="qwen2", sliding_window=1000)
    assert load_model_config(windowed).layer_windows == (1000, 1000)
    half = init_model("tiny", tmp_path / "half", architecture="qwen2", sliding_window=24, max_window_layers=1)
    assert load_model_config(half).layer_windows == (None, 24)
    hybrid = init_model("tiny", tmp_path / "h", architecture="qwen2", sliding_window=24,
                        layer_types=("sliding_attention", "full_attention"))
    assert load_model_config(hybrid).layer_windows == (24, None)


def test_sharding_writes_an_index_covering_every_tensor(tmp_path: Path) -> None:
    folder = init_model("small", tmp_path / "s", shard_size=1_000_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == sorted(checkpoint_shapes(load_model_config(folder)))
    assert {folder / name for name in index["weight_map"].values()} == set(shards)
    for shard in shards:
        tensors = load_file(shard)
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= 1_000_000


def test_dtype_is_written_and_loads_into_float32(tmp_path: Path) -> None:
    folder = init_model("tiny", tmp_path / "bf16", dtype="bfloat16")
    assert load_model_config(folder).torch_dtype == "bfloat16"
    assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}
    model, _ = load_model(folder, torch.float32, "cpu")
    assert model.lm_head.weight.dtype == torch.float32


def test_bad_arguments(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="huge"):
        init_model("huge", tmp_path / "x")
    with pytest.raises(ValueError, match="gpt2"):
        init_model("tiny", tmp_path / "x", architecture="gpt2")
    with pytest.raises(ValueError, match="int8"):
        init_model("tiny", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="sliding_window"):
        init_model("tiny", tmp_path / "x", sliding_window=64)
    with pytest.raises(ValueError, match="layer_types"):  # transformers' Mistral would ignore them
        init_model("tiny", tmp_path / "x", architecture="mistral", sliding_window=8,
                   layer_types=("full_attention", "sliding_attention"))
    with pytest.raises(FileExistsError):
        init_model("tiny", tiny_model_dir)


def test_byte_tokenizer_round_trips_and_matches_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    assert tokenizer is not None
    text = "héllo, wörld!\n\t  ✓ 世界"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([256, *tokenizer.encode("ab"), 257]) == "ab"
    cfg = load_model_config(tiny_model_dir)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_ids[0])
    assert tokenizer.vocab_size == 258 <= cfg.vocab_size
    assert Tokenizer.from_dir(tmp_path) is None


def greedy(folder: Path, steps: int) -> list[int]:
    """Greedy continuation of one byte, recomputing the whole prefix each step (no runner here)."""
    model, cfg = load_model(folder, torch.float32, "cpu")
    tokens = [ord("a")]
    for _ in range(steps):
        n = len(tokens)
        caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        meta = AttentionMetadata(
            torch.arange(n), 0, torch.zeros((0, 1), dtype=torch.long), torch.zeros(0, dtype=torch.long),
            (PrefillSpan(0, n, n, torch.arange(4)),), 16,
        )  # fmt: skip
        hidden = model(torch.tensor(tokens), torch.arange(n), meta, caches, NoHooks())
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[1:]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "qwen2_model_dir"])
def test_random_models_generate_varied_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    tokens = greedy(request.getfixturevalue(fixture), 24)
    assert len(set(tokens)) >= 8, tokens
