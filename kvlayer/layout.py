"""The shape of a model's KV cache, as kvlayer sees it.

A paged cache (the engine's) holds one tensor per layer; kvlayer reads and writes it through a
view ``[planes, num_blocks, block_size, num_kv_heads, head_dim]``, where a slot is ``block *
block_size + offset``. ``planes`` is 2 for attention that keeps keys and values (index 0 = keys,
1 = values), 1 for MLA's one latent vector per token (``LATENT_CACHE_LAYOUT``: no K/V split, one
"head" as wide as the latent, docs/architecture.md section 12). ``KVLayout.cache_layout`` names
how the engine's own tensor is laid out and ``paged_view`` makes that view of it, without
copying (docs/architecture.md section 10). An engine whose blocks pack K and V in its own way
(vLLM's CPU attention) is copied block by block, as opaque bytes: the view then has one row per
block, and a slot is a block id.
kvlayer stores chunks ``[num_layers, planes, chunk_tokens, num_kv_heads, head_dim]`` whatever the
engine's layout (docs/architecture.md section 4): per-layer slices are contiguous.
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


DEFAULT_CACHE_LAYOUT = "kv-block-token-head-dim"
"""The bundled engine's cache layout, ``[2, num_blocks, block_size, kv_heads, head_dim]`` per
layer, also FlashAttention's in vLLM on CUDA: copied token row by token row."""
LATENT_CACHE_LAYOUT = "latent-block-token-dim"
"""MLA's cache (DeepSeek V2/V3; vLLM's MLA backends), ``[num_blocks, block_size, latent_dim]`` per
layer: one latent vector per token (the compressed KV and the rotary key part together), no
K/V split and no heads. A ``KVLayout`` of it has ``num_kv_heads == 1`` and ``head_dim`` the
latent width; copied token row by token row, as the default layout."""
BLOCKS = "blocks:"
"""The prefix of an opaque-block cache layout (see ``KVLayout.cache_layout``)."""


@dataclass(frozen=True, slots=True)
class WindowGroup:
    """Layers that keep the same span of KV (docs/architecture.md section 12): ``window`` None for
    full attention (every token), else W, a query at position ``p`` reading keys ``j`` with
    ``p - W < j <= p``. ``layers`` are the model's layer indices, ascending."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        """``"full"`` or ``"window:<W>"`` (the keys of ``kv_stats()["loaded_tokens"]``)."""
        return "full" if self.window is None else f"window:{self.window}"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What kvlayer needs to know of a model's KV cache: layers, heads, dtype, paging."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    cache_layout: str = DEFAULT_CACHE_LAYOUT
    """How the engine's per-layer cache tensor is laid out: ``DEFAULT_CACHE_LAYOUT``, or
    ``LATENT_CACHE_LAYOUT`` for MLA's latent vectors, or ``"blocks:<tag>"`` for an engine whose
    blocks kvlayer copies whole, as opaque bytes (``tag`` names the engine's packing, e.g. vLLM's
    CPU attention and its ISA). Part of the key namespace where it is not the default, so chunks
    are shared only between engines whose caches are laid out alike."""
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: full attention), or ``()`` when no layer slides. A
    windowed layout is *window-aware* in the tiers: a hit loads a window layer's KV only for the
    tokens it can still attend to, and a layout whose layers keep different spans (a hybrid)
    stores each ``window_groups`` member as a chunk object of its own (``kvlayer.windows``). Opaque
    blocks allow windows too: the window-aware selection works on whole chunks, and chunks are
    whole engine blocks."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")
        dtype_name(self.dtype)
        if self.cache_layout not in (DEFAULT_CACHE_LAYOUT, LATENT_CACHE_LAYOUT) and not (
                self.cache_layout.startswith(BLOCKS) and len(self.cache_layout) > len(BLOCKS)):
            raise ValueError(f"unknown cache layout {self.cache_layout!r}; known: {DEFAULT_CACHE_LAYOUT!r}, "
                             f"{LATENT_CACHE_LAYOUT!r} and {BLOCKS!r}<tag>")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w is not None and (not isinstance(w, int) or w <= 0) for w in self.layer_windows):
            raise ValueError(f"layer windows must be positive ints or None, got {self.layer_windows}")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"a latent (MLA) layout has one vector per token: num_kv_heads must be 1, "
                             f"got {self.num_kv_heads}")

    @property
    def latent(self) -> bool:
        """Whether a layer keeps one latent vector per token (MLA) instead of keys and values."""
        return self.cache_layout == LATENT_CACHE_LAYOUT

    @property
    def planes(self) -> int:
        """Planes per layer and token: 2 (keys, values), or 1 for a latent layout."""
        return 1 if self.latent else 2

    @property
    def windowed(self) -> bool:
        """Whether some layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def window_groups(self) -> tuple[WindowGroup, ...]:
        """The layers grouped by their window: full attention first, then windows ascending;
        one group of every layer when all keep the same span."""
        windows = self.layer_windows or (None,) * self.num_layers
        spans = sorted(set(windows), key=lambda w: -1 if w is None else w)
        return tuple(WindowGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in spans)

    @property
    def opaque_blocks(self) -> bool:
        """Whether copies move whole engine blocks as bytes (``"blocks:..."``), not token rows."""
        return self.cache_layout.startswith(BLOCKS)

    @property
    def copy_unit(self) -> int:
        """Tokens per copied row: 1 for token rows, ``block_size`` for opaque blocks. Slots
        (``kvlayer.transfer``) then name token slots or block ids, and every copy of opaque
        blocks must start and end on a block boundary."""
        return self.block_size if self.opaque_blocks else 1

    def paged_view(self, cache: torch.Tensor) -> torch.Tensor:
        """One layer of the engine's cache as the 5-d view ``kvlayer.transfer`` copies through,
        over the same memory: ``[planes, num_blocks, block_size, num_kv_heads, head_dim]`` for the
        default and latent layouts (a latent cache ``[num_blocks, block_size, latent_dim]`` is
        ``[1, num_blocks, block_size, 1, latent_dim]``), ``[1, num_blocks, 1, 1, block_elements]``
        (a block as one row) for opaque blocks. ``ValueError`` if its dtype or size does not
        fit, or it is not one contiguous tensor where opaque blocks need that."""
        per_block = self.planes * self.block_size * self.num_kv_heads * self.head_dim
        if cache.dtype != self.dtype or cache.numel() % per_block or cache.dim() == 0:
            raise ValueError(f"a {tuple(cache.shape)} {cache.dtype} cache does not fit {self}")
        blocks = cache.numel() // per_block
        if not self.opaque_blocks:
            return cache.view(self.planes, blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if not cache.is_contiguous():
            raise ValueError(f"opaque blocks need a contiguous cache, got strides {cache.stride()}")
        return cache.view(1, blocks, 1, 1, per_block)

    def chunk_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """A chunk ``[num_layers, planes, tokens, kv_heads, head_dim]`` (contiguous) seen as the rows
        ``paged_view`` copies: itself, or ``[num_layers, 1, tokens // block_size, 1, block_elements]``
        for opaque blocks (whose bytes are then the engine's blocks, in order)."""
        if not self.opaque_blocks:
            return chunk
        per_block = self.planes * self.block_size * self.num_kv_heads * self.head_dim
        return chunk.view(chunk.shape[0], 1, chunk.shape[2] // self.block_size, 1, per_block)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (keys and values, or the latent vector)."""
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * self.element_size

    def chunk_shape(self, tokens: int, layers: int = 0) -> tuple[int, int, int, int, int]:
        """Shape of a chunk of ``tokens`` tokens and ``layers`` layers (0: every layer; a layer
        group's chunk holds its own, ``ChunkKey.layers``)."""
        return (layers or self.num_layers, self.planes, tokens, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token
