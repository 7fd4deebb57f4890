"""Milliseconds per read of the same chunks through each Redis read path, alternated in one process.

The paths: the tier's fast path (``backends/redis_reads.py``) as ``get_many`` (whole chunks into
staging), as ``read_layers`` by layer groups (one layer per group at the ``bench`` layout) and in
one group (a whole load); and redis-py's ``MGET`` parsed and decoded (``redis_pairs.decode_pair``,
the path of cluster mode and compressed tiers). With ``--old-from REV`` it also times the read
paths of commit REV whose ``backends/redis_reads.py`` still read through ``redis_replies.py``
(the protocol swapped into redis-py's connection), loaded from git beside today's. With
``--range-kib 256,512,...`` it times ``get_many`` with each size as the fast path's largest
``GETRANGE`` (``redis_reads.RANGE_BYTES``) instead.

Every path first reads the chunks once and must return them exactly; then each round runs every
path once, in an order rotated each round, and the median of the rounds is reported. The chunks
are the ``bench`` preset's (6 MiB, float32, 256 tokens), on a throwaway local ``redis-server``.

Run: ``.venv/bin/python -m tests.backends.bench_redis_reads --chunks 8 --rounds 15 [--old-from ef5e719]
[--range-kib 256,512,1024]``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from kvlayer.backends import redis_reads
from kvlayer.backends.redis import RedisBackend
from kvlayer.backends.redis_pairs import Expected
from kvlayer.benchmarks.redis_local import LocalRedis
from kvlayer.config import KVLayerConfig
from kvlayer.engine.presets import PRESETS
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.read_plan import layer_groups
from kvlayer.storage import BackendContext
from tests.backends.test_nvme import put_keys
from tests.fakes import chunk_data, make_keys, namespace

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 256
Path_ = Callable[[], Awaitable[list[MemoryObj | None] | None]]


def old_paths(rev: str, backend: RedisBackend, names: list[Any], wants: list[Expected], keys: list[Any],
              outs: list[MemoryObj], groups: list[tuple[int, int]]) -> dict[str, Path_]:
    """The whole-chunk and layer-group reads of commit ``rev``, on redis-py's pooled connections."""
    folder = Path(tempfile.mkdtemp(prefix="kvlayer-old-reads-")) / "old_redis"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for name in ("redis_reads", "redis_replies", "redis_pairs"):
        text = subprocess.run(["git", "show", f"{rev}:backends/{name}.py"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
        (folder / f"{name}.py").write_text(text)
    sys.path.insert(0, str(folder.parent))
    old = importlib.import_module("old_redis.redis_reads")
    old_wants = [old.Expected(w.key, w.shape, w.dtype, w.staging) for w in wants]

    async def pooled(read: Callable[[Any], Awaitable[Any]]) -> Any:
        pool = backend._connection().connection_pool
        conn = await pool.get_connection()
        try:
            return await read(conn)
        except BaseException:
            await conn.disconnect(nowait=True)  # left mid-reply
            raise
        finally:
            await pool.release(conn)

    async def whole() -> list[MemoryObj | None]:
        return [r.obj for r in await pooled(lambda c: old.read_whole_on(c, names, old_wants))]

    async def by_groups() -> None:
        values = await pooled(lambda c: old.read_layers_on(c, names, keys, outs, groups, lambda g: None))
        if not all(v.verified() for v in values):
            raise RuntimeError("the old layer-group read missed")

    return {f"{rev}: MGET through redis_replies (get_many)": whole,
            f"{rev}: GETRANGE by groups through redis_replies (read_layers)": by_groups}


def with_ranges(read: Path_, kib: int) -> Path_:
    """``read`` with GETRANGEs of at most ``kib`` KiB."""
    async def run() -> list[MemoryObj | None] | None:
        default, redis_reads.RANGE_BYTES = redis_reads.RANGE_BYTES, kib << 10
        try:
            return await read()
        finally:
            redis_reads.RANGE_BYTES = default

    return run


async def measure(url: str, chunks: int, rounds: int, old_from: str | None,
                  range_kib: list[int]) -> dict[str, list[float]]:
    spec = PRESETS["bench"]
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, 16)
    size = layout.chunk_bytes(TOKENS)
    cfg = KVLayerConfig(chunk_size=TOKENS, cpu_capacity=0, redis_url=url, tier_timeout_ms=60_000)
    staging = Arena(2 * chunks * size, size)
    backend = RedisBackend.create(BackendContext(cfg, layout, torch.device("cpu"), staging))
    assert backend is not None
    keys = make_keys(chunks, 1, namespace(chunk_size=TOKENS, layout=layout))
    await put_keys(backend, keys, layout)  # type: ignore[arg-type]
    arena = Arena(chunks * size, size)
    outs = [o for o in (arena.allocate(layout.chunk_shape(TOKENS), layout.dtype) for _ in keys) if o is not None]
    groups = layer_groups(layout.num_layers, size // layout.num_layers)
    wants = [Expected(k, layout.chunk_shape(TOKENS), layout.dtype, staging) for k in keys]

    async def layers(g: list[tuple[int, int]]) -> None:
        if await backend.read_layers(keys, outs, g, lambda _: None) != [True] * len(keys):
            raise RuntimeError("read_layers missed")

    async def parsed() -> list[MemoryObj | None]:
        return [r.obj for r in await backend._get_parsed(wants)]

    paths: dict[str, Path_] = {
        "fast path: get_many": lambda: backend.get_many(keys),
        f"fast path: read_layers, {len(groups)} groups": lambda: layers(groups),
        "fast path: read_layers, one group": lambda: layers([(0, layout.num_layers)]),
        "redis-py: MGET + decode_pair (get_many)": parsed,
    }
    if range_kib:
        paths = {f"fast path: get_many, ranges of {kib} KiB": with_ranges(paths["fast path: get_many"], kib)
                 for kib in range_kib}
    if old_from:
        paths |= old_paths(old_from, backend, [backend.redis_keys(k) for k in keys], wants, keys, outs, groups)
    want = [chunk_data(k, layout) for k in keys]
    for name, path in paths.items():  # each path must be exact before it is timed
        for o in outs:
            o.tensor.zero_()
        got = await path()
        tensors = [o.tensor for o in outs] if got is None else [o.tensor if o else None for o in got]
        if not all(t is not None and torch.equal(t, w) for t, w in zip(tensors, want)):
            raise RuntimeError(f"{name} did not read the chunks exactly")
        for o in got or ():
            if o is not None:
                o.release()
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for _ in range(rounds):
        for name in order:
            start = time.perf_counter()
            got = await paths[name]()
            times[name].append((time.perf_counter() - start) * 1000)
            for o in got or ():
                if o is not None:
                    o.release()
        order = order[1:] + order[:1]
    await backend.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--old-from", help="also time the read paths of this commit (git rev)")
    p.add_argument("--range-kib", help="time get_many with these largest GETRANGEs instead (KiB, comma-separated)")
    args = p.parse_args()
    with LocalRedis() as server:
        sizes = [int(x) for x in args.range_kib.split(",")] if args.range_kib else []
        times = asyncio.run(measure(server.url, args.chunks, args.rounds, args.old_from, sizes))
    mib = args.chunks * PRESETS["bench"].num_layers * 2 * TOKENS * PRESETS["bench"].num_kv_heads \
        * PRESETS["bench"].head_dim * 4 / 2**20
    print(f"{args.chunks} chunks ({mib:.0f} MiB) a read, median of {args.rounds} alternated rounds:")
    for name, ts in times.items():
        med = statistics.median(ts)
        rate = mib / 1024 / med * 1000
        print(f"  {name:62s} {med:7.1f} ms  (min {min(ts):6.1f}, max {max(ts):6.1f})  {rate:5.2f} GiB/s")


if __name__ == "__main__":
    main()
