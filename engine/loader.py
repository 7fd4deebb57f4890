"""Loading a Hugging Face model folder (config.json + safetensors) into a ``CausalLM``, and fingerprinting it.

``load_model(folder, dtype, device)`` checks every tensor against the names and shapes the
config implies (``checkpoint_shapes``) and copies them in one at a time, so peak memory is the
model plus one tensor. ``model_fingerprint`` (from ``kvlayer.model_files``, shared with the vLLM
connector) identifies the weights cheaply, for kvlayer's key namespace.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvlayer.engine.model import CausalLM
from kvlayer.engine.model_config import ModelConfig, load_model_config
from kvlayer.model_files import INDEX_FILE, ModelLoadError, checkpoint_files, model_fingerprint

__all__ = ["INDEX_FILE", "ModelLoadError", "checkpoint_files", "checkpoint_shapes", "load_model", "model_fingerprint"]

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must hold (Hugging Face names) and its shape."""
    model = CausalLM(config, torch.float32, "meta")
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


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
