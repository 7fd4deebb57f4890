"""Loading a Hugging Face model folder (config.json + safetensors) into a ``CausalLM``, and fingerprinting it.

``load_model(folder, dtype, device)`` checks every tensor against the names and shapes the
config implies (``checkpoint_shapes``) and copies them in one at a time, so peak memory is the
model plus one tensor. ``model_fingerprint(folder)`` identifies the weights cheaply, for
kvlayer's key namespace: it reads headers and a fixed sample of each file, not the whole file.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvlayer.engine.model import CausalLM
from kvlayer.engine.model_config import ModelConfig, load_model_config

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


class ModelLoadError(ValueError):
    """A checkpoint that does not match its config, or a corrupt or truncated file; the message
    names the tensor or file. A ValueError: the model folder given is bad input."""


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must hold (Hugging Face names) and its shape."""
    model = CausalLM(config, torch.float32, "meta")
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def checkpoint_files(path: str | Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else every ``*.safetensors``."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelLoadError(
                f"{INDEX_FILE} in {str(folder)!r} has no valid weight_map: {error!r}"
            ) from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"shard {file.name!r} named in {INDEX_FILE} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {str(folder)!r}")
    return files


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[CausalLM, ModelConfig]:
    """Build the model of folder ``path`` in ``dtype`` on ``device`` and load its weights.

    Raises ``ModelConfigError`` for a bad config and ``ModelLoadError`` naming the first
    missing, unexpected or wrongly shaped tensor, or the file that is corrupt or truncated.
    ``rotary_emb.inv_freq`` buffers are ignored, and so is an ``lm_head.weight`` saved beside
    tied embeddings.
    """
    config = load_model_config(path)
    model = CausalLM(config, dtype, device)
    params = model.state_dict()
    expected = {name: tuple(tensor.shape) for name, tensor in params.items()}
    seen: set[str] = set()
    for file in checkpoint_files(path):
        try:
            _load_file(file, config, params, expected, seen)
        except SafetensorError as error:  # its message names no file
            raise ModelLoadError(f"{str(file)!r} is corrupt or truncated: {error}") from None
    missing = [name for name in expected if name not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]!r} is missing from the checkpoint{more}")
    return model, config


def _load_file(file: Path, config: ModelConfig, params: dict[str, torch.Tensor],
               expected: dict[str, tuple[int, ...]], seen: set[str]) -> None:
    """Copy the tensors of one safetensors ``file`` into ``params``, adding their names to ``seen``."""
    with safe_open(str(file), framework="pt", device="cpu") as reader:
        for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
            tied_head = config.tie_word_embeddings and name == "lm_head.weight"
            if name.endswith(_IGNORED_SUFFIXES) or tied_head:
                continue
            if name not in expected:
                raise ModelLoadError(f"unexpected tensor {name!r} in {file.name}")
            if name in seen:
                raise ModelLoadError(f"tensor {name!r} appears twice (again in {file.name})")
            shape = tuple(reader.get_slice(name).get_shape())
            if shape != expected[name]:
                raise ModelLoadError(f"tensor {name!r} in {file.name} has shape {shape}, expected {expected[name]}")
            params[name].copy_(reader.get_tensor(name))
            seen.add(name)


def model_fingerprint(path: str | Path) -> str:
    """A hex blake2b digest of config.json and, per safetensors file, its header and 16 evenly
    spaced 64 KiB samples of its data: stable across processes, fast for any model size."""
    folder = Path(path)
    digest = hashlib.blake2b(digest_size=32)
    config = folder / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"config.json is missing from model folder {str(folder)!r}")
    _update(digest, b"config.json", config.read_bytes())
    for file in checkpoint_files(folder):
        size = file.stat().st_size
        with file.open("rb") as stream:
            head = stream.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if 8 + header_len > size:
                raise ModelLoadError(f"{str(file)!r} is corrupt or truncated: its header runs past the end of the file")
            _update(digest, file.name.encode(), stream.read(header_len))
            data_start = 8 + header_len
            data_len = size - data_start
            for offset in _sample_offsets(data_len):
                stream.seek(data_start + offset)
                _update(digest, offset.to_bytes(8, "little"), stream.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _sample_offsets(data_len: int) -> list[int]:
    """Where the samples start: the whole data when it is small, else 16 evenly spaced windows."""
    if data_len <= _SAMPLES * _SAMPLE_BYTES:
        return list(range(0, data_len, _SAMPLE_BYTES))
    last = data_len - _SAMPLE_BYTES
    return [i * last // (_SAMPLES - 1) for i in range(_SAMPLES)]


def _update(digest: hashlib.blake2b, label: bytes, data: bytes) -> None:
    """Feed ``label`` and ``data``, each length-prefixed so boundaries cannot shift."""
    for part in (label, data):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
