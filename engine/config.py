"""``EngineConfig``: the engine's own settings, validated once and never mutated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlayer.devices import parse_device
from kvlayer.sizes import parse_size

__all__ = ["EngineConfig", "parse_device", "parse_engine_dtype"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}

DEFAULT_KV_CACHE_MEMORY = 1024**3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of the bundled engine (see ``LLM`` for their meaning)."""

    model: str
    device: torch.device
    dtype: torch.dtype
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        parse_device(self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}")


def parse_engine_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    try:
        return _DTYPES[dtype.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16") from None


def parse_memory(value: int | str | None) -> int | None:
    return None if value is None else parse_size(value)
