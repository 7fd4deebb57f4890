"""Test doubles shared by the suite: a tiny KV layout, keys, chunk data and a faulty backend.

``FakeBackend`` is a serialising tier held in a dict (puts copy the bytes out, gets allocate
from a staging arena, as nvme and redis do) whose calls can be made to raise or hang, to
test deadlines, counters and health. Everything runs on the CPU.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import torch

from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey, Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext, StorageBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)
CHUNK = 4
"""Tokens per chunk in these tests: one chunk of ``LAYOUT`` is 512 bytes."""
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)


def namespace(salt: str = "", chunk_size: int = CHUNK, layout: KVLayout = LAYOUT) -> Namespace:
    return Namespace("tiny-test-model", "fingerprint-0", layout, chunk_size, salt=salt)


def make_keys(num_chunks: int, seed: int = 0, ns: Namespace | None = None) -> list[ChunkKey]:
    """Keys of ``num_chunks`` full chunks of random tokens (``seed`` picks the sequence)."""
    ns = ns or namespace()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_chunks * ns.chunk_size,), generator=gen).tolist()
    return chunk_keys(ns, tokens)


def chunk_data(key: ChunkKey, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """The deterministic content of ``key``'s chunk (so every read can be checked exactly)."""
    gen = torch.Generator().manual_seed(int.from_bytes(key.digest[:8], "little"))
    return torch.randn(layout.chunk_shape(key.num_tokens), generator=gen).to(layout.dtype)


def make_chunk(arena: Arena, key: ChunkKey, layout: KVLayout = LAYOUT) -> MemoryObj:
    """A new object (one reference, the caller's) in ``arena`` holding ``chunk_data(key)``."""
    obj = arena.allocate(layout.chunk_shape(key.num_tokens), layout.dtype)
    assert obj is not None, f"{arena.name} is full"
    obj.tensor.copy_(chunk_data(key, layout).to(obj.tensor.device))
    return obj


def make_chunks(arena: Arena, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
    return [make_chunk(arena, k) for k in keys]


def staging(slots: int = 64) -> Arena:
    return Arena(slots * CHUNK_BYTES, CHUNK_BYTES, name="test staging")


def context(staging_arena: Arena | None = None, device: str = "cpu", **config: object) -> BackendContext:
    """A context for ``LAYOUT`` with ``CHUNK``-token chunks; ``config`` sets ``KVLayerConfig`` fields."""
    cfg = KVLayerConfig.from_dict({"chunk_size": CHUNK, "cpu_capacity": 0, **config})
    return BackendContext(cfg, LAYOUT, torch.device(device), staging_arena or staging())


class FakeBackend(StorageBackend):
    """A dict-backed serialising tier with fault injection.

    ``fault``: None (works), "raise" (every call raises ``OSError``) or "hang" (every call
    waits forever, until cancelled). ``delay_s`` delays every call; while ``paused`` is set,
    ``put_many`` waits (to observe writes still in flight). ``calls`` counts calls per method.
    ``get_many`` allocates its answers from ``staging`` (None when it is full).
    """

    def __init__(self, staging_arena: Arena, name: str = "fake", rank: int = 20, in_memory: bool = False,
                 fault: str | None = None, delay_s: float = 0.0) -> None:
        self.name, self.rank, self.in_memory = name, rank, in_memory
        self.staging = staging_arena
        self.fault = fault
        self.delay_s = delay_s
        self.paused = False
        self.data: dict[bytes, tuple[bytes, torch.Tensor]] = {}
        self.calls: Counter[str] = Counter()
        self.checksum_errors = 0
        self.closed = False

    @classmethod
    def create(cls, ctx: BackendContext) -> FakeBackend | None:
        return None

    async def _enter(self, method: str) -> None:
        self.calls[method] += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fault == "raise":
            raise OSError(f"{self.name}: injected failure in {method}")
        if self.fault == "hang":
            await asyncio.Event().wait()

    def holds(self, key: ChunkKey) -> bool:
        return key.digest in self.data

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        await self._enter("contains_prefix")
        n = 0
        while n < len(keys) and self.data.get(keys[n].digest, (None,))[0] == keys[n].tokens_digest:
            n += 1
        return n

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        await self._enter("get_many")
        out: list[MemoryObj | None] = []
        for key in keys:
            stored = self.data.get(key.digest)
            obj = None
            if stored is not None and stored[0] == key.tokens_digest:
                obj = self.staging.allocate(tuple(stored[1].shape), stored[1].dtype)
                if obj is not None:
                    obj.tensor.copy_(stored[1])
            out.append(obj)
        return out

    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        await self._enter("put_many")
        while self.paused:
            await asyncio.sleep(0.005)
        for key, chunk in zip(keys, chunks, strict=True):
            if key.digest not in self.data:
                self.data[key.digest] = (key.tokens_digest, chunk.tensor.detach().to("cpu", copy=True))
        self._admitted([k.digest for k in keys])

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        await self._enter("remove")
        gone = [k.digest for k in keys if self.data.pop(k.digest, None) is not None]
        self._evicted(gone)
        return len(gone)

    def usage(self) -> tuple[int, int]:
        return sum(t.numel() * t.element_size() for _, t in self.data.values()), 0

    def keys(self) -> list[bytes]:
        return list(self.data)

    def stats(self) -> dict[str, int]:
        return {"checksum_errors": self.checksum_errors, "chunks": len(self.data)}

    async def close(self) -> None:
        self.closed = True
