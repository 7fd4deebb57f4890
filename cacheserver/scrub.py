"""``Scrubber``: the cache server verifies its own arena (docs/cache-server.md, "What is verified").

One asyncio task on the server's loop takes what to verify from the ``ChunkIndex``, hashes it on
one worker thread (xxh3-64 of the arena bytes, as a client's commit hashed them; xxhash lets go
of the GIL), and gives the results back to the index on the loop. So the index is only ever
touched by the loop, and the loop never waits on a hash.

- **Seal.** Every commit is verified as soon as the thread is free, commits before anything else;
  a match seals the chunk (``LEASE`` then tells clients they need not hash it).
- **Re-scrub.** When no commit waits, sealed chunks are hashed again, the one verified longest ago
  first, at most ``rate`` bytes per second (0: never; commits are still sealed) and at most
  ``1 / RESCRUB_MIN_HOP_S`` hand-offs to the thread per second. A stray write into the arena is
  thus found within about capacity / rate seconds.
- **A mismatch** drops the chunk, or spoils it while it is leased (``ChunkIndex.checked``);
  ``checksum_errors`` counts it, the first one is logged at warning. A chunk evicted, removed or
  stored anew while it was being hashed is skipped.

The arena is mapped read-only here: the scrub cannot write a byte of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import xxhash

from kvlayer.cacheserver.index import ChunkIndex

log = logging.getLogger(__name__)

SEAL_BATCH = 64 << 20
"""The most bytes of commits one hop to the thread hashes (past the first chunk)."""
RESCRUB_SLICE_S = 0.1
"""A re-scrub hop hashes about this many seconds' worth of the rate (at least one chunk)."""
RESCRUB_MIN_HOP_S = 0.05
"""Re-scrub hops start at least this far apart, so a nearly empty arena is not hashed in a spin
(each hop costs a thread hand-off however few bytes it hashes)."""


class Scrubber:
    """Verifies ``index``'s chunks in the arena file at ``path`` (``size`` bytes); re-scrubs at
    ``rate`` bytes per second (0: seals only; ``ValueError`` if negative). ``start`` on the loop."""

    def __init__(self, index: ChunkIndex, path: str, size: int, rate: int) -> None:
        if rate < 0:
            raise ValueError(f"--scrub-mib-s must be 0 or more, got {rate / 2**20:g}")
        self.index = index
        self.rate = rate
        self.hashed_bytes = 0
        """Bytes hashed so far, seals and re-scrubs."""
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mapping: mmap.mmap | None = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = memoryview(self._mapping)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlayer-scrub")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    def start(self) -> None:
        """Run the scrub on the running loop until ``close``."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvlayer-scrub")
        self._task.add_done_callback(_report)

    def wake(self) -> None:
        """New commits wait to be sealed (loop thread)."""
        self._wake.set()

    def close(self) -> None:
        """Stop (a hash under way finishes first) and unmap; idempotent."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._pool.shutdown(wait=True)
        if self._mapping is not None:
            self._view.release()
            with contextlib.suppress(BufferError):  # a slice still exported: the process ends soon
                self._mapping.close()
            self._mapping = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_rescrub = 0.0
        while True:
            self._wake.clear()  # before looking: a commit from now on wakes us again
            batch, rescrub = self.index.to_seal(SEAL_BATCH), False
            wait = next_rescrub - time.monotonic()
            if not batch and self.rate and self.index.sealed and wait <= 0:
                batch, rescrub = self.index.to_rescrub(max(1, int(self.rate * RESCRUB_SLICE_S))), True
            if not batch:
                timeout = wait if self.rate and self.index.sealed else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            began = time.monotonic()
            sums = await loop.run_in_executor(self._pool, self._hash, [(e.offset, e.size) for _, e in batch])
            nbytes = sum(e.size for _, e in batch)
            self.hashed_bytes += nbytes
            if rescrub:
                next_rescrub = max(next_rescrub, began) + max(nbytes / self.rate, RESCRUB_MIN_HOP_S)
            bad = self.index.checked([(d, e, got) for (d, e), got in zip(batch, sums)])
            if bad:
                log.log(logging.DEBUG if self._warned else logging.WARNING,
                        "cache-server: chunk %s does not match its checksum in the arena; dropped (%d so far)",
                        bad[0].hex()[:16], self.index.checksum_errors)
                self._warned = True

    def _hash(self, ranges: list[tuple[int, int]]) -> list[int]:
        """The xxh3-64 of each ``(offset, size)`` of the arena (worker thread)."""
        view = self._view
        return [xxhash.xxh3_64_intdigest(view[offset:offset + size]) for offset, size in ranges]


def _report(task: asyncio.Task[None]) -> None:
    """Log a scrub that died (a bug): the server goes on, its chunks unsealed from then on."""
    if not task.cancelled() and task.exception() is not None:
        log.error("cache-server: the scrub stopped: %r", task.exception())
