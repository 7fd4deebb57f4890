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

Every function returns GiB/s, best of ``repeat`` runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

GIB = 2**30


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


def redis_rates(url: str, count: int, size: int, repeat: int) -> dict[str, float]:
    """GiB/s of one pipeline of ``count`` ``SET``s of ``size``-byte values, and of ``GET``s of them."""
    import redis
    from redis.connection import Encoder, PythonRespSerializer

    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    client = redis.Redis.from_url(url, command_packer=packer, socket_timeout=120)
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
