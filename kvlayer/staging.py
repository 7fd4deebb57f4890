"""``Staging``: the host chunks that loads and saves pass through (docs/architecture.md section 4).

One arena of pinned host memory (plain memory where CUDA is absent), allocated once and carved
into chunk-shaped ``MemoryObj``s of one ``KVLayout``. It is not a cache tier: a staging chunk
lives only while a transfer uses it (a lower tier's read landing, a save waiting for its tiers),
and serialising tiers deserialise into it (``BackendContext.staging``).
"""

from __future__ import annotations

from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.metrics import Metrics


class Staging:
    """Chunks of ``layout`` carved from ``arena`` (host memory, slots of at least one chunk) for
    transfers; a full arena is counted in ``metrics``."""

    def __init__(self, arena: Arena, layout: KVLayout, metrics: Metrics) -> None:
        self.arena = arena
        self.layout = layout
        self._metrics = metrics

    @classmethod
    def create(cls, layout: KVLayout, chunk_size: int, capacity_bytes: int, metrics: Metrics) -> Staging:
        """A new pinned arena of ``capacity_bytes`` (at least one chunk of ``chunk_size`` tokens)."""
        chunk_bytes = layout.chunk_bytes(chunk_size)
        arena = Arena(max(capacity_bytes, chunk_bytes), chunk_bytes, "cpu", pin=True, name="kvlayer staging")
        return cls(arena, layout, metrics)

    def allocate(self, key: ChunkKey) -> MemoryObj | None:
        """An uninitialised chunk for ``key`` (one reference, the caller's), or None when staging
        memory is full (counted in the ``staging`` tier's ``errors``): the transfer then stops
        at that chunk, a miss for a load, an unsaved chunk for a save."""
        obj = self.arena.allocate(self.layout.chunk_shape(key.num_tokens, len(key.layers)), self.layout.dtype)
        if obj is None:
            self._metrics.count("staging", "errors")
        return obj
