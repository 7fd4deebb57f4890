"""How the NVMe tier runs its blocking file reads on worker threads, safely under cancellation.

A read thread writes into a staging slot the caller may stop waiting for (a deadline, a
cancelled load); the slot must not go back to the arena, where another read could be handed
it, while that thread still writes into it. So a cancelled helper here either waits for its
threads before it raises, or leaves the slot's release to the end of the thread. The file
formats and the reads themselves live in ``backends/nvme_files.py``; the backend
(``backends/nvme.py``) counts the outcomes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from kvlayer.io_loop import blocking_executor
from kvlayer.memory import MemoryObj

from .nvme_files import RangedFile

T = TypeVar("T")


async def fill(obj: MemoryObj, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread that writes into ``obj``; ``obj`` is released if it fails.

    If the caller is cancelled, ``obj`` is released only once the thread is done, so its slot
    is never handed out again while the thread still writes into it.
    """
    fut = asyncio.get_running_loop().run_in_executor(blocking_executor(), fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: (obj.release(), f.cancelled() or f.exception()))
        raise
    except BaseException:
        obj.release()
        raise


async def read_groups(reads: Sequence[RangedFile | None], groups: Sequence[tuple[int, int]],
                      threads: int, on_group: Callable[[int], None]) -> None:
    """Read layer group g of every file whose read has no error yet, split over at most
    ``threads`` worker threads, then call ``on_group(g)``; group g + 1 only after that. Errors
    stay in each read's ``chunk.error``; a None read is skipped."""
    for g, (lo, hi) in enumerate(groups):
        live = [r for r in reads if r is not None and r.chunk.error is None]
        n = max(1, min(threads, len(live)))
        await _on_threads([partial(_read_range, live[i::n], lo, hi) for i in range(n)])
        on_group(g)


def _read_range(reads: Sequence[RangedFile], lo: int, hi: int) -> None:
    for r in reads:
        r.read(lo, hi)


async def _on_threads(jobs: Sequence[Callable[[], None]]) -> None:
    """Run ``jobs`` on worker threads at once; returns (even when cancelled) only once all are done."""
    loop = asyncio.get_running_loop()
    executor = blocking_executor()
    futures = [loop.run_in_executor(executor, job) for job in jobs]
    try:
        await asyncio.shield(asyncio.gather(*futures))
    except asyncio.CancelledError:
        await asyncio.wait(futures)
        raise


async def cancel_and_release(tasks: Sequence[asyncio.Future[MemoryObj | None]]) -> None:
    """Stop ``tasks`` and release the chunks those that finished had allocated for nobody."""
    for t in tasks:
        t.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, MemoryObj):
            result.release()
