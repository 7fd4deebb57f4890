"""The shape of a model's KV cache, as kvlayer sees it.

A paged cache (the engine's) holds, per layer, a tensor ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (index 0 = keys, 1 = values); a slot is ``block * block_size +
offset``. kvlayer stores chunks ``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``
(docs/architecture.md section 4): per-layer slices are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported KV dtype ("float32", "float16", "bfloat16")."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(_DTYPES)}")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A supported KV dtype from its name or itself; ValueError names the bad value."""
    if isinstance(name, torch.dtype):
        dtype_name(name)
        return name
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What kvlayer needs to know of a model's KV cache: layers, heads, dtype, paging."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")
        dtype_name(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (keys and values)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    def chunk_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a chunk of ``tokens`` tokens."""
        return (self.num_layers, 2, tokens, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token
