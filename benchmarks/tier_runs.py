"""Timed puts and gets through one storage tier, for ``kvlayer bench tiers``.

``Batch.random`` makes ``count`` chunks of random float32 KV with their keys;
``measure_tier`` builds the tier from a ``KVLayerConfig``, then per run removes the batch,
puts it (timed) and gets it back (timed; for nvme also cold, after dropping the page cache);
an untimed first run warms up and checks the chunks come back exact (with ``storage_quantization``,
within its error bound). Figures are GiB/s of raw KV bytes, and the bytes the tier stored per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlayer.benchmarks.tier_ceilings import GIB, drop_page_cache
from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey, Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.quantize import QUANTIZERS
from kvlayer.storage import BackendContext, StorageBackend


@dataclass(frozen=True, slots=True)
class Batch:
    """``count`` chunks of ``tokens`` tokens (one reference each, owned by the batch) and their keys."""

    layout: KVLayout
    tokens: int
    keys: list[ChunkKey]
    chunks: list[MemoryObj]

    @classmethod
    def random(cls, layout: KVLayout, tokens: int, count: int, seed: int = 0) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        chunk_bytes = layout.chunk_bytes(tokens)
        arena = Arena(count * chunk_bytes, chunk_bytes, "cpu", name="bench chunks")
        ids = torch.randint(3, 30_000, (count * tokens,), generator=gen).tolist()
        keys = chunk_keys(Namespace("bench-tiers", f"seed-{seed}", layout, tokens), ids)
        chunks = []
        for _ in keys:
            obj = arena.allocate(layout.chunk_shape(tokens), layout.dtype)
            assert obj is not None
            obj.tensor.copy_(torch.randn(obj.shape, generator=gen))
            chunks.append(obj)
        return cls(layout, tokens, keys, chunks)

    @property
    def count(self) -> int:
        return len(self.keys)

    @property
    def chunk_bytes(self) -> int:
        return self.layout.chunk_bytes(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.count * self.chunk_bytes

    def close(self) -> None:
        """Release the chunks (the batch is unusable afterwards)."""
        for c in self.chunks:
            c.release()
        self.chunks.clear()


async def measure_tier(tier: str, config: KVLayerConfig, batch: Batch, repeat: int) -> dict[str, float | None]:
    """``put_gib_s`` and ``get_gib_s`` of ``tier`` built from ``config`` (nvme: also ``get_cold_gib_s``,
    None where the page cache cannot be dropped) and ``stored_bytes_per_token`` (what the tier wrote
    per token, headers included; the KV's own for cpu). RuntimeError if the tier misses or alters a
    chunk (beyond the error bound of ``config.storage_quantization``)."""
    backend = _build(tier, config, batch)
    dest = torch.empty((batch.count, *batch.layout.chunk_shape(batch.tokens)), dtype=batch.layout.dtype)
    # The CPU tier answers with its own slots: the copy out of them is part of getting the bytes.
    consume = (lambda objs: [dest[i].copy_(o.tensor) for i, o in enumerate(objs)]) if tier == "cpu" else None
    cold = _dropper(Path(config.nvme_path)) if tier == "nvme" else None
    put = get = get_cold = float("inf")
    try:
        for run in range(repeat + 1):  # run 0 warms up (memory touched, connections made), untimed
            await backend.remove(batch.keys)
            start = time.perf_counter()
            await backend.put_many(batch.keys, batch.chunks)
            put = min(put, time.perf_counter() - start) if run else put
            took = await _timed_get(backend, batch, consume, check=config.storage_quantization if run == 0 else None)
            get = min(get, took) if run else get
            if cold is not None and cold():
                took = await _timed_get(backend, batch, consume, check=None)
                get_cold = min(get_cold, took) if run else get_cold
        written = backend.stats().get("bytes_written", (repeat + 1) * batch.nbytes)
    finally:
        await backend.close()
    gib = batch.nbytes / GIB
    out: dict[str, float | None] = {"put_gib_s": gib / put, "get_gib_s": gib / get,
                                    "stored_bytes_per_token": written / ((repeat + 1) * batch.count * batch.tokens)}
    if tier == "nvme":
        out["get_cold_gib_s"] = gib / get_cold if get_cold < float("inf") else None
    return out


def redis_memory_ratio(config: KVLayerConfig, batch: Batch) -> float:
    """Redis memory (``MEMORY USAGE`` of both keys of each chunk: values, names and overheads) per
    byte of KV, over the batch's chunks under ``config``'s prefix (still stored by
    ``measure_tier``'s last run); then deletes them."""
    import redis

    from kvlayer.backends.redis_pairs import chunk_names

    client = redis.Redis.from_url(str(config.redis_url), socket_timeout=60)
    prefix = f"{config.redis_key_prefix}:".encode()
    names = [name for k in batch.keys for name in chunk_names(prefix, k)]
    try:
        used = [client.memory_usage(n, samples=0) for n in names]
        if any(u is None for u in used):
            raise RuntimeError("a chunk the tier stored is missing from Redis")
        return sum(used) / batch.nbytes
    finally:
        client.delete(*names)
        client.close()


def _build(tier: str, config: KVLayerConfig, batch: Batch) -> StorageBackend:
    from kvlayer.backends.cpu import CpuBackend
    from kvlayer.backends.nvme import NvmeBackend
    from kvlayer.backends.redis import RedisBackend

    classes: dict[str, type[StorageBackend]] = {"cpu": CpuBackend, "nvme": NvmeBackend, "redis": RedisBackend}
    staging = Arena(config.staging_capacity, batch.chunk_bytes, "cpu", name="bench staging")
    backend = classes[tier].create(BackendContext(config, batch.layout, torch.device("cpu"), staging))
    if backend is None:
        raise ValueError(f"the configuration does not enable the {tier} tier")
    return backend


async def _timed_get(backend: StorageBackend, batch: Batch, consume: Callable[[Sequence[MemoryObj]], Any] | None,
                     check: str | None) -> float:
    """Seconds to get the whole batch (and ``consume`` it); every chunk must come back, and with
    ``check`` (a ``storage_quantization``) be the batch's (exact, or within that error bound)."""
    start = time.perf_counter()
    got = await backend.get_many(batch.keys)
    try:
        if any(obj is None for obj in got):
            raise RuntimeError(f"the {backend.name} tier missed {got.count(None)} of {batch.count} chunks")
        objs = [obj for obj in got if obj is not None]
        if consume is not None:
            consume(objs)
        elapsed = time.perf_counter() - start
        if check is not None and not all(_close(o.tensor, c.tensor, check) for o, c in zip(objs, batch.chunks)):
            raise RuntimeError(f"the {backend.name} tier returned altered chunks")
        return elapsed
    finally:
        for obj in got:
            if obj is not None:
                obj.release()


def _close(got: torch.Tensor, want: torch.Tensor, quantization: str) -> bool:
    """Whether ``got`` is ``want`` stored under ``quantization`` (exact for none)."""
    if quantization == "none":
        return torch.equal(got, want)
    bound = QUANTIZERS[quantization].error_bound(want)
    return bool(((got.float() - want.float()).abs() <= bound * (1 + 1e-5) + 1e-6).all())


def _dropper(root: Path) -> Callable[[], bool]:
    """Drops the page cache of every chunk file under ``root``; False where unsupported."""
    return lambda: drop_page_cache([str(p) for p in root.rglob("*.kvc")])
