"""A real full filesystem under the cache server's NVMe tier: a tiny tmpfs in a private mount
namespace (``tests/backends/private_mount.py``) that runs out of bytes, or of inodes, under a
running server whose clients are ``KVCacheEngine`` processes' tiers.

Each time: chunks stored before the disk filled are on it; once it is full, new chunks still land
in the arena and come back exact to a fresh engine, while their writes down fail, one
``nvme_write_errors`` count each, leaving no file behind; nothing raises and the server keeps
serving. Once room is made, the next chunks are written down again, and the chunks on disk are
read back exact after a restart of the server.

The server runs in the child process (``CacheServer`` on its own event loop thread, as ``kvlayer
cache-server`` runs it) so its lower tiers' counters can be read; the engines talk to it over its
real socket. Run: ``.venv/bin/python -m pytest tests/cacheserver/test_lower_full.py`` (as root, or a
user allowed ``unshare -r -m``; skips elsewhere).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.backends.private_mount import fill_up, run_with_mount, tmpfs, use_up_inodes

from . import worker

CASES: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "no bytes left": (tmpfs("1m"), lambda mount: fill_up(mount / "filler")),
    "no inodes left": (tmpfs("4m", inodes=64), use_up_inodes),
}
"""How the disk is filled: its mount, and the filler given the mount's folder (a file, or empty files)."""
FILLERS = ("filler", "inode-")


class ServerThread:
    """A ``CacheServer`` with an NVMe lower tier at ``root``, served on its own loop thread."""

    def __init__(self, socket_path: str, root: str) -> None:
        from kvlayer.cacheserver.lower import LowerTiers
        from kvlayer.cacheserver.server import CacheServer
        from kvlayer.config import KVLayerConfig

        config = KVLayerConfig.load({"nvme_path": root, "nvme_capacity": "64MiB"})
        self.server = CacheServer(socket_path, 1 << 20, lower=LowerTiers.from_config(config))
        self._started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.server.start()
        self._started.set()
        await self.server.serve_until(self._stop)

    def lower(self) -> dict[str, int]:
        """The lower tiers' counters, read on the server's loop."""
        assert self.server.lower is not None
        return asyncio.run_coroutine_threadsafe(_call(self.server.lower.stats), self._loop).result(10)

    def wait_written(self, n: int) -> dict[str, int]:
        """The counters once ``n`` chunks in all went through the write-through (written or failed)."""
        deadline = time.monotonic() + 10
        while (stats := self.lower())["written"] < n:
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
        return stats

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive()


async def _call(fn: Callable[[], dict[str, int]]) -> dict[str, int]:
    return fn()


def _tokens(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(len(worker.TOKENS))]


def store_and_check(sock: str, root: str, i: int, store: bool = True) -> tuple[int, bool, list[str]]:
    """Sequence ``i`` stored by one engine (unless not ``store``) and retrieved by a fresh one (from
    the server): the tokens retrieved, whether exact, and the chunk files under ``root`` its keys name."""
    from kvlayer import KVCacheEngine
    from kvlayer.backends.nvme_files import chunk_path

    def engine() -> KVCacheEngine:
        return KVCacheEngine(worker.kv_config(sock), worker.layout(), model_name="m", model_fingerprint="f")

    src = worker.kv_caches(i + 1)
    with engine() as kv:
        assert not store or kv.store(_tokens(i), src, worker.slots(40, 0)) == 5
        keys = kv.keys(_tokens(i))
    dst = worker.kv_caches(None)
    with engine() as kv:
        n = kv.retrieve(_tokens(i), dst, worker.slots(40, 20))
    exact = worker.rows(dst, worker.slots(40, 20)) == worker.rows(src, worker.slots(40, 0))
    return n, exact, [chunk_path(root, k.digest, 0) for k in keys]


def full_disk(folder: str, case: str) -> dict[str, Any]:
    """In the child (the tmpfs mounted at ``folder``): the figures the test checks."""
    mount = Path(folder)
    root = str(mount / "kv")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvcs-") as tmp:
        sock = os.path.join(tmp, "cache.sock")
        server = ServerThread(sock, root)
        try:
            n, exact, files = store_and_check(sock, root, 0)
            out["before"] = {"tokens": n, "exact": exact, "on_disk": sum(map(os.path.exists, files)),
                             "lower": server.wait_written(5)}
            CASES[case][1](mount)
            n, exact, files = store_and_check(sock, root, 1)
            out["full"] = {"tokens": n, "exact": exact, "on_disk": sum(map(os.path.exists, files)),
                           "lower": server.wait_written(10),
                           "temporary": [p.name for p in Path(root).rglob(".tmp-*")]}
            for p in mount.iterdir():
                if p.name.startswith(FILLERS):
                    p.unlink()
            n, exact, files = store_and_check(sock, root, 2)
            out["freed"] = {"tokens": n, "exact": exact, "on_disk": sum(map(os.path.exists, files)),
                            "lower": server.wait_written(15)}
        finally:
            server.stop()
        server = ServerThread(sock, root)  # a new arena: hits come from the files written down
        try:
            out["restarted"] = [store_and_check(sock, root, i, store=False)[:2] for i in range(3)]
            out["restarted_lower"] = server.lower()
        finally:
            server.stop()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_full_disk_under_the_server_is_counted_and_served_around(tmp_path: Path, case: str) -> None:
    folder = tmp_path / "mnt"
    folder.mkdir()
    got = run_with_mount(folder, CASES[case][0], "tests.cacheserver.test_lower_full", "full_disk", case)
    before, full, freed = got["before"], got["full"], got["freed"]
    assert (before["tokens"], before["exact"], before["on_disk"]) == (40, True, 5)
    assert before["lower"]["nvme_write_errors"] == 0
    # full: the arena serves the new chunks exactly; each write down failed once, counted, no file left
    assert (full["tokens"], full["exact"], full["on_disk"]) == (40, True, 0)
    assert full["lower"]["nvme_write_errors"] == 5 and full["temporary"] == []
    assert full["lower"]["write_errors"] == 0  # the tier itself never raised, so it was not backed off
    # room again: the next chunks go down
    assert (freed["tokens"], freed["exact"], freed["on_disk"]) == (40, True, 5)
    assert freed["lower"]["nvme_write_errors"] == 5 and freed["lower"]["skipped_writes"] == 0
    assert got["restarted"] == [[40, True], [0, False], [40, True]]  # from the files, the arena gone
    assert got["restarted_lower"]["promoted"] == 10
