"""The ``KVCacheEngine`` rows of ``kvlayer bench tiers``: ``retrieve`` and durable ``store`` of one
sequence through each tier, next to that tier's raw ceiling measured in the same rounds.

The sequence (``PagedSequence``) is ``tokens`` tokens of the preset's KV layout (float32) in
paged caches of twice the blocks it needs (block size 16), at the slots of a random block
table; caches and buffers are touched before anything is timed. ``measure_engine`` builds a
``KVCacheEngine`` with only the given tier enabled, stores the sequence and checks that
``retrieve`` brings it back exact, then runs ``repeat`` rounds (after an untimed warm-up round)
alternating each of our figures with its ceiling (``tier_ceilings.alternated_times``), and keeps
medians:

- retrieve: ``KVCacheEngine.retrieve`` of every token into the caches. Ceilings: cpu, one
  ``index_copy_`` per layer from a contiguous buffer (the faster of float and 16-byte
  elements); nvme, ``readinto`` of the tier's own files into one buffer, warm (in the page
  cache) and cold (their pages dropped first, untimed, by ``posix_fadvise(DONTNEED)``; ours
  likewise); redis, one raw pipeline of ``GET``s of the tier's own keys.
- store: the tier emptied (``evict_all``, untimed), then ``store`` + ``flush`` (the write has
  reached the tier). Ceilings: cpu, one ``index_select`` per layer into a contiguous buffer;
  nvme, writes of new files of the tier's file sizes (no fsync, like the tier); redis, one raw
  pipeline of ``SET``s of values of the tier's value sizes.

GiB/s count the sequence's KV bytes; ``ratio`` is ours over the ceiling's GiB/s (the ceiling's
median time over ours).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlayer.benchmarks.tier_ceilings import (  # noqa: E402
    GIB,
    GOAL_RATIO,
    REDIS_PREFIX,
    Run,
    alternated_times,
    drop_page_cache,
    gather_run,
    raw_client,
    read_files_run,
    redis_get_run,
    redis_set_runs,
    scatter_runs,
    write_files_runs,
)
from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.transfer import slot_mapping

Timed = tuple[Run, Run | None]
"""A run and what runs untimed before it."""


@dataclass(frozen=True, slots=True)
class PagedSequence:
    """One sequence's KV in paged caches: ``src`` holds it at ``slots`` (``store`` reads there),
    ``dst`` is where ``retrieve`` writes it; ``kv`` is a contiguous buffer of its shape for the
    ceilings. The caches are ``[2, num_blocks, BLOCK_SIZE, kv_heads, head_dim]``, one per layer."""

    layout: KVLayout
    token_ids: list[int]
    slots: torch.Tensor
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    kv: torch.Tensor

    @classmethod
    def random(cls, layout: KVLayout, tokens: int, seed: int = 0) -> PagedSequence:
        gen = torch.Generator().manual_seed(seed)
        blocks = -(-tokens // layout.block_size)
        table = torch.randperm(2 * blocks, generator=gen)[:blocks].tolist()
        shape = (2, 2 * blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        return cls(layout, torch.randint(3, 30_000, (tokens,), generator=gen).tolist(),
                   slot_mapping(table, layout.block_size, 0, tokens),
                   [torch.randn(shape, generator=gen) for _ in range(layout.num_layers)],
                   [torch.zeros(shape) for _ in range(layout.num_layers)],
                   torch.randn(layout.chunk_shape(tokens), generator=gen))

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_bytes(len(self.token_ids))

    def retrieved(self) -> bool:
        """Whether ``dst`` holds ``src``'s KV at every slot."""
        def at(cache: torch.Tensor) -> torch.Tensor:
            return cache.view(2, -1, self.layout.num_kv_heads, self.layout.head_dim)[:, self.slots]

        return all(torch.equal(at(d), at(s)) for d, s in zip(self.dst, self.src))


@dataclass(frozen=True, slots=True)
class _Figure:
    """One of our figures and its ceiling's variants (the fastest one counts)."""

    op: str
    reads: str
    ours: Timed
    ceiling: str
    variants: dict[str, Timed]


@dataclass(frozen=True, slots=True)
class _Setup:
    """What a tier's figures are built from; ``cleanup`` takes what must be undone at the end."""

    engine: KVCacheEngine
    seq: PagedSequence
    keys: list[ChunkKey]
    folder: str
    url: str | None
    cleanup: contextlib.ExitStack

    def retrieve(self) -> None:
        n = self.engine.retrieve(self.seq.token_ids, self.seq.dst, self.seq.slots)
        if n != len(self.seq.token_ids):
            raise RuntimeError(f"retrieve gave back {n} of {len(self.seq.token_ids)} tokens")

    def store(self) -> None:
        n = self.engine.store(self.seq.token_ids, self.seq.src, self.seq.slots)
        self.engine.flush(timeout=600)
        if n != len(self.keys):
            raise RuntimeError(f"store took {n} of {len(self.keys)} chunks")

    def evict(self) -> None:
        self.engine.evict_all()


def engine_config(tier: str, layout: KVLayout, chunk_tokens: int, nbytes: int, folder: str,
                  url: str | None) -> KVLayerConfig:
    """The configuration enabling only ``tier``, sized for ``nbytes`` of KV (deadlines out of the way)."""
    chunk = layout.chunk_bytes(chunk_tokens)
    settings: dict[str, Any] = {"chunk_size": chunk_tokens, "tier_timeout_ms": 600_000, "cpu_capacity": 0,
                                "staging_capacity": 2 * nbytes + chunk}
    if tier == "cpu":
        settings["cpu_capacity"] = nbytes + chunk
    elif tier == "nvme":
        settings.update(nvme_path=str(Path(folder) / "engine-nvme"), nvme_capacity=4 * nbytes)
    else:
        settings.update(redis_url=url, redis_key_prefix=REDIS_PREFIX)
    return KVLayerConfig(**settings)


def measure_engine(tier: str, seq: PagedSequence, chunk_tokens: int, repeat: int, folder: str,
                   url: str | None) -> list[dict[str, Any]]:
    """Our figures and their ceilings' for ``tier`` (see the module docstring), one row each.
    RuntimeError if the tier does not give the sequence back exact."""
    config = engine_config(tier, seq.layout, chunk_tokens, seq.nbytes, folder, url)
    # the stack unwinds first (last in, first out), the engine closes after it
    with KVCacheEngine(config, seq.layout, model_name="bench-tiers") as engine, contextlib.ExitStack() as cleanup:
        cleanup.callback(engine.evict_all)
        setup = _Setup(engine, seq, engine.keys(seq.token_ids), folder, url, cleanup)
        setup.store()
        for cache in seq.dst:
            cache.zero_()
        setup.retrieve()
        if not seq.retrieved():
            raise RuntimeError(f"the {tier} tier gave back altered KV")
        figures = _FIGURES[tier](setup)
        runs = {(i, name): timed for i, f in enumerate(figures)
                for name, timed in [("ours", f.ours), *f.variants.items()]}
        times = alternated_times(runs, repeat)
    return [_row(tier, f, {name: times[i, name] for i, name in runs if i == k}, seq.nbytes)
            for k, f in enumerate(figures)]


def _row(tier: str, figure: _Figure, times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    variants = {name: statistics.median(times[name]) for name in figure.variants}
    best = min(variants, key=variants.__getitem__)
    seconds, ceiling = statistics.median(times["ours"]), variants[best]
    ratio = ceiling / seconds
    return {"tier": tier, "op": figure.op, "reads": figure.reads, "seconds": seconds, "runs_s": times["ours"],
            "gib_s": nbytes / seconds / GIB, "ceiling": figure.ceiling, "ceiling_variant": best,
            "ceiling_variants_s": variants, "ceiling_runs_s": times[best], "ceiling_seconds": ceiling,
            "ceiling_gib_s": nbytes / ceiling / GIB, "ratio": ratio, "goal_met": ratio >= GOAL_RATIO}


def _cpu(s: _Setup) -> list[_Figure]:
    out = torch.empty_like(s.seq.kv)
    scatter = {name: (run, None) for name, run in scatter_runs(s.seq.dst, s.seq.slots, s.seq.kv).items()}
    return [_Figure("retrieve", "-", (s.retrieve, None), "index_copy", scatter),
            _Figure("store", "-", (s.store, s.evict), "index_select",
                    {"index_select": (gather_run(s.seq.src, s.seq.slots, out), None)})]


def _nvme(s: _Setup) -> list[_Figure]:
    root = Path(s.engine.config.nvme_path or "")

    def files() -> list[str]:
        return sorted(str(p) for p in root.rglob("*.kvc"))

    sizes = [os.path.getsize(p) for p in files()]
    read = read_files_run(files, memoryview(bytearray(b"\1") * sum(sizes)))
    write, clear = write_files_runs(tempfile.mkdtemp(prefix="raw-writes-", dir=s.folder), sizes)
    s.cleanup.callback(clear)
    out = [_Figure("retrieve", "warm", (s.retrieve, None), "file_read", {"file_read": (read, None)})]
    if drop_page_cache(files()):
        drop: Callable[[], object] = lambda: drop_page_cache(files())
        out.append(_Figure("retrieve", "cold", (s.retrieve, drop), "file_read", {"file_read": (read, drop)}))
    out.append(_Figure("store", "-", (s.store, s.evict), "file_write", {"file_write": (write, clear)}))
    return out


def _redis(s: _Setup) -> list[_Figure]:
    from kvlayer.backends.redis_pairs import chunk_names

    client = raw_client(str(s.url))
    s.cleanup.callback(client.close)
    names = [n for k in s.keys for n in chunk_names(f"{REDIS_PREFIX}:".encode(), k)]
    sizes = [int(client.strlen(n)) for n in names]
    put, clear = redis_set_runs(client, sizes, f"{REDIS_PREFIX}-raw")
    s.cleanup.callback(clear)
    get = redis_get_run(client, names)
    return [_Figure("retrieve", "-", (s.retrieve, None), "redis_get", {"redis_get": (get, None)}),
            _Figure("store", "-", (s.store, s.evict), "redis_set", {"redis_set": (put, clear)})]


_FIGURES: dict[str, Callable[[_Setup], list[_Figure]]] = {"cpu": _cpu, "nvme": _nvme, "redis": _redis}
"""Per tier: our figures and their ceilings."""
