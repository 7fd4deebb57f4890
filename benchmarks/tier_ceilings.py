"""Raw ceilings for ``kvlayer bench tiers``: what the hardware and the client library give for
the same bytes, with none of kvlayer's work (headers, checksums, indexes, staging).

- memory: torch copies, chunk by chunk, into memory already touched (the CPU tier's put and
  get are such copies);
- files: plain sequential ``write``/``readinto`` of same-size files, one at a time; reads
  warm (just written, in the page cache) and cold (after ``fsync`` and
  ``posix_fadvise(DONTNEED)``, which drops a clean file's cached pages without root);
- Redis: redis-py's synchronous client, pipelined ``SET``/``GET`` of same-size values,
  packing commands with ``PythonRespSerializer`` (a large value is sent as its own piece;
  the hiredis packer copies it into one buffer first, several times slower here).

Every ``*_rate(s)`` function returns GiB/s, best of ``repeat`` runs. The ``KVCacheEngine`` rows
(``kvlayer.benchmarks.tier_engine``) alternate their own runs with these ceilings' single runs,
timed by ``alternated_times``:

- ``scatter_runs``/``gather_run``: one torch ``index_copy_``/``index_select`` per layer of a
  sequence's slots from/into a contiguous buffer (scatters both with float and with 16-byte
  elements, since ``kvlayer.transfer`` moves rows as the latter where it can);
- ``read_files_run``/``write_files_runs``: ``readinto`` of given files, ``write`` of new ones;
- ``redis_get_run``/``redis_set_runs``: one raw pipeline of ``GET``s of given names, or of
  ``SET``s of values of given sizes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import redis
    import torch

GIB = 2**30

# The engine rows' settings and ceilings (benchmarks/tier_engine.py), kept here, apart from torch,
# so that building the command line imports no torch.
GOAL_RATIO = 0.8
BLOCK_SIZE = 16
REDIS_PREFIX = "kvlayer-bench-engine"
CEILINGS = {
    "index_copy": "torch index_copy_ per layer of the same slots from a contiguous buffer, the faster of float "
                  "and 16-byte (complex128) elements",
    "index_select": "torch index_select per layer of the same slots into a contiguous buffer",
    "file_read": "readinto of the tier's own files into one buffer; cold = after fsync + posix_fadvise(DONTNEED)",
    "file_write": "write of new files of the tier's file sizes, no fsync",
    "redis_get": "redis-py sync client, one pipeline of GETs of the tier's own keys",
    "redis_set": "redis-py sync client, one pipeline of SETs of values of the tier's value sizes",
}
Run = Callable[[], object]
K = TypeVar("K", bound=Hashable)


def best_seconds(repeat: int, run: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    """The shortest wall time of ``repeat`` calls of ``run``, after one untimed warm-up call
    (``before`` runs untimed ahead of each)."""
    best = float("inf")
    for i in range(max(1, repeat) + 1):  # the first call warms up, untimed
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def memcpy_rate(count: int, size: int, repeat: int) -> float:
    """GiB/s of ``count`` torch copies of ``size`` bytes each into memory already touched (one
    copy per chunk, as the CPU tier makes them: on a busy machine, each parallel copy waits
    for its worker threads, so one large copy would overstate the ceiling)."""
    import torch

    src = torch.ones((count, max(size // 4, 1)), dtype=torch.float32)
    dst = torch.zeros_like(src)

    def copy() -> None:
        for i in range(count):
            dst[i].copy_(src[i])

    return src.numel() * 4 / best_seconds(repeat, copy) / GIB


def drop_page_cache(paths: Sequence[str]) -> bool:
    """Flush each file and ask the kernel to drop its cached pages; False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def file_rates(folder: str, count: int, size: int, repeat: int) -> dict[str, float | None]:
    """GiB/s of writing ``count`` files of ``size`` bytes under ``folder``, and of reading them
    back warm and cold (``get_cold`` is None where the page cache cannot be dropped)."""
    data = os.urandom(size)
    buf = bytearray(size)
    work = tempfile.mkdtemp(prefix="raw-", dir=folder)
    paths = [os.path.join(work, f"{i}.bin") for i in range(count)]

    def clear() -> None:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    def write() -> None:
        for p in paths:
            with open(p, "wb", buffering=0) as f:
                f.write(data)

    def read() -> None:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(buf)

    total = count * size / GIB
    try:
        put = total / best_seconds(repeat, write, clear)
        warm = total / best_seconds(repeat, read)
        cold = None
        if drop_page_cache(paths):
            cold = total / best_seconds(repeat, read, lambda: drop_page_cache(paths))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"put": put, "get_warm": warm, "get_cold": cold}


def raw_client(url: str) -> redis.Redis:
    """A redis-py synchronous client packing commands with ``PythonRespSerializer`` (see above)."""
    import redis
    from redis.connection import Encoder, PythonRespSerializer

    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis.from_url(url, command_packer=packer, socket_timeout=120)


def redis_rates(url: str, count: int, size: int, repeat: int) -> dict[str, float]:
    """GiB/s of one pipeline of ``count`` ``SET``s of ``size``-byte values, and of ``GET``s of them."""
    client = raw_client(url)
    names = [f"kvlayer-bench-raw:{i}" for i in range(count)]
    data = os.urandom(size)

    def pipelined(op: Callable[[redis.client.Pipeline, str], object]) -> Callable[[], None]:
        def run() -> None:
            pipe = client.pipeline(transaction=False)
            for n in names:
                op(pipe, n)
            pipe.execute()
        return run

    total = count * size / GIB
    try:
        put = total / best_seconds(repeat, pipelined(lambda p, n: p.set(n, data)), lambda: client.delete(*names))
        get = total / best_seconds(repeat, pipelined(lambda p, n: p.get(n)))
    finally:
        client.delete(*names)
        client.close()
    return {"put": put, "get": get}


# ----- single runs, for the KVCacheEngine rows -------------------------------------------------
def alternated_times(runs: Mapping[K, tuple[Run, Run | None]], repeat: int) -> dict[K, list[float]]:
    """The wall times of ``repeat`` rounds, each calling every ``(run, before)`` of ``runs`` once in
    turn (``before`` untimed ahead of its run), after one untimed warm-up round: alternating so
    that every figure sees the same machine load."""
    times: dict[K, list[float]] = {name: [] for name in runs}
    for i in range(max(1, repeat) + 1):
        for name, (run, before) in runs.items():
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


def wide_rows(rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` ``[2, n, kv_heads, head_dim]`` (contiguous) as ``[2, n, row_bytes // 16]`` complex128,
    None where a row is not a multiple of 16 bytes."""
    import torch

    two, n, heads, dim = rows.shape
    if (heads * dim * rows.element_size()) % 16 or not rows.is_contiguous():
        return None
    return rows.view(two, n, heads * dim).view(torch.complex128)


def scatter_runs(caches: Sequence[torch.Tensor], slots: torch.Tensor, src: torch.Tensor) -> dict[str, Run]:
    """One ``index_copy_`` per layer of ``src`` ``[layers, 2, n, kv_heads, head_dim]`` (contiguous)
    into paged ``caches`` at ``slots``: by float elements (``float``) and, where rows allow, by
    16-byte ones (``wide``)."""
    flats = [c.view(2, -1, c.shape[3], c.shape[4]) for c in caches]

    def by_float() -> None:
        for layer, flat in enumerate(flats):
            flat.index_copy_(1, slots, src[layer])

    out: dict[str, Run] = {"float": by_float}
    wide = [(wide_rows(f), wide_rows(src[layer])) for layer, f in enumerate(flats)]
    if all(d is not None and s is not None for d, s in wide):
        def by_wide() -> None:
            for dst, rows in wide:
                dst.index_copy_(1, slots, rows)  # type: ignore[union-attr]

        out["wide"] = by_wide
    return out


def gather_run(caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> Run:
    """One ``index_select`` per layer of ``caches`` at ``slots`` into ``out`` ``[layers, 2, n, kv_heads, head_dim]``."""
    import torch

    flats = [c.view(2, -1, c.shape[3], c.shape[4]) for c in caches]

    def run() -> None:
        for layer, flat in enumerate(flats):
            torch.index_select(flat, 1, slots, out=out[layer])

    return run


def read_files_run(paths: Callable[[], Sequence[str]], buf: memoryview) -> Run:
    """``readinto`` of each file ``paths()`` lists, whole, into consecutive parts of ``buf``."""
    def run() -> None:
        at = 0
        for p in paths():
            with open(p, "rb", buffering=0) as f:
                at += f.readinto(buf[at:])

    return run


def write_files_runs(folder: str, sizes: Sequence[int]) -> tuple[Run, Run]:
    """``(write, clear)``: write one new file per size under ``folder`` (no fsync), delete them.
    Each file gets bytes of its own, as the tier's do: one buffer written again and again would
    be read from the CPU's cache, which no store of distinct chunks can do."""
    datas = [os.urandom(size) for size in sizes]
    paths = [os.path.join(folder, f"{i}.bin") for i in range(len(sizes))]

    def write() -> None:
        for p, data in zip(paths, datas):
            with open(p, "wb", buffering=0) as f:
                f.write(data)

    def clear() -> None:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    return write, clear


def redis_get_run(client: redis.Redis, names: Sequence[bytes]) -> Run:
    """One pipeline of ``GET``s of ``names``; RuntimeError if one is missing."""
    def run() -> None:
        pipe = client.pipeline(transaction=False)
        for n in names:
            pipe.get(n)
        if any(v is None for v in pipe.execute()):
            raise RuntimeError("a value the ceiling reads is missing from Redis")

    return run


def redis_set_runs(client: redis.Redis, sizes: Sequence[int], prefix: str) -> tuple[Run, Run]:
    """``(set, clear)``: one pipeline of ``SET``s of random values of ``sizes`` under ``prefix``
    (a value of its own each, as in ``write_files_runs``), delete them."""
    datas = [os.urandom(size) for size in sizes]
    names = [f"{prefix}:{i}" for i in range(len(sizes))]

    def put() -> None:
        pipe = client.pipeline(transaction=False)
        for n, data in zip(names, datas):
            pipe.set(n, data)
        pipe.execute()

    def clear() -> None:
        client.delete(*names)

    return put, clear
