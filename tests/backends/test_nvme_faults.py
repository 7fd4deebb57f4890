"""Fault injection for the NVMe tier: every fault is a miss (or a failed put), a counter, no exception.

Covers corrupt, truncated, swapped, replaced and vanished files, EIO on read, EACCES at open,
ENOSPC or EIO at fsync and rename, a real read-only folder (EROFS, in a private mount namespace),
the start-up scan, and a writer killed with SIGKILL. A real full disk: ``test_disk_full.py``.
Run: ``.venv/bin/python -m pytest tests/backends/test_nvme_faults.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import serde
from kvlayer.backends import nvme_files
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from tests.backends.private_mount import READ_ONLY, record_write_failures, run_with_mount
from tests.backends.test_nvme import (
    chain,
    expected,
    fingerprint,
    get_fingerprints,
    make_backend,
    put_keys,
    run,
    run_child,
    temp_files,
)


def file_of(root: Path, key: ChunkKey) -> Path:
    return Path(nvme_files.chunk_path(str(root), key.digest, key.start))


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


CORRUPTIONS: dict[str, Callable[[Path, Path], None]] = {
    "payload bit flip": lambda victim, other: flip_bit(victim, serde.HEADER_SIZE + 77),
    "header bit flip": lambda victim, other: flip_bit(victim, 20),
    "truncated": lambda victim, other: truncate(victim),
    "extended": lambda victim, other: victim.write_bytes(victim.read_bytes() + b"tail"),
    "replaced by another key's valid chunk": lambda victim, other: shutil.copyfile(other, victim),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_corrupt_file_is_a_counted_miss_and_is_deleted(tmp_path: Path,
                                                         corrupt: Callable[[Path, Path], None]) -> None:
    keys = chain(3)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        corrupt(file_of(tmp_path, keys[1]), file_of(tmp_path, keys[2]))
        want = expected(keys)
        assert await get_fingerprints(backend, keys) == [want[0], None, want[2]]
        assert backend.stats()["checksum_errors"] == 1
        assert not file_of(tmp_path, keys[1]).exists()
        assert await backend.contains_prefix(keys) == 1
        assert backend._staging.used_count == 0

    run(scenario())


def test_files_swapped_between_two_keys_are_both_misses(tmp_path: Path) -> None:
    keys = chain(2)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        a, b = file_of(tmp_path, keys[0]), file_of(tmp_path, keys[1])
        tmp = a.with_name("swap")
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
        assert await get_fingerprints(backend, keys) == [None, None]
        assert backend.stats()["checksum_errors"] == 2 and backend.stats()["misses"] == 2
        assert backend.keys() == []

    run(scenario())


def test_a_file_deleted_behind_the_index_is_an_io_miss(tmp_path: Path) -> None:
    keys = chain(2)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        file_of(tmp_path, keys[0]).unlink()
        assert await get_fingerprints(backend, keys) == [None, expected(keys)[1]]
        assert backend.stats()["io_errors"] == 1
        assert await backend.contains_prefix(keys[:1]) == 0

    run(scenario())


def test_eio_on_read_is_a_miss_logged_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    keys = chain(3)

    def broken_read(path: str, *args: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error", path)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        monkeypatch.setattr(nvme_files, "read_file", broken_read)
        monkeypatch.setattr(nvme_files, "read_into", broken_read)
        with caplog.at_level(logging.WARNING, logger="kvlayer.backends"):
            assert await get_fingerprints(backend, keys) == [None] * 3
        assert backend.stats()["io_errors"] == 3
        assert len(caplog.records) == 1, "one log line per kind of fault, not one per chunk"
        assert await backend.contains_prefix(keys) == 3, "an EIO may pass: the file is kept"
        monkeypatch.undo()
        assert await get_fingerprints(backend, keys) == expected(keys)

    run(scenario())


def _refuse_write_opens(code: int) -> Callable[..., Any]:
    real_open = os.open

    def fake_open(path: str, flags: int, *args: Any, **kw: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *args, **kw)

    return fake_open


def _fail(code: int) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        raise OSError(code, os.strerror(code))
    return call


WRITE_FAULTS: dict[str, tuple[Any, str, Any]] = {  # nvme_files.os is the os module: the faults hit the real calls
    # what no real filesystem gives root here: EACCES (root ignores mode bits), a failing fsync or
    # rename (tmpfs never fails them); a full and a read-only disk are real in test_disk_full.py
    # and test_a_read_only_folder_fails_puts_cleanly
    "EACCES at open": (nvme_files.os, "open", _refuse_write_opens(errno.EACCES)),
    "ENOSPC at the file's fsync": (nvme_files.os, "fsync", _fail(errno.ENOSPC)),
    "ENOSPC at rename": (nvme_files.os, "replace", _fail(errno.ENOSPC)),
    "EIO at the folder's fsync": (nvme_files, "_fsync_dir", _fail(errno.EIO)),
}


@pytest.mark.parametrize("fault", WRITE_FAULTS.values(), ids=WRITE_FAULTS.keys())
def test_failed_writes_are_counted_and_reads_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   fault: tuple[Any, str, Any]) -> None:
    """Each failed write is a count and leaves nothing on disk (no temporary file, no chunk file
    the index does not know: a file whose folder could not be flushed is deleted again)."""
    old, new, later = chain(3, seed=1), chain(3, seed=2), chain(2, seed=3)

    async def scenario() -> None:
        backend = make_backend(tmp_path, nvme_fsync=True)
        await put_keys(backend, old)
        used, files = backend.usage(), chunk_files(tmp_path)
        monkeypatch.setattr(*fault)
        await put_keys(backend, new)
        assert backend.stats()["write_errors"] == 3
        assert temp_files(tmp_path) == []
        assert chunk_files(tmp_path) == files
        assert backend.usage() == used
        assert await backend.contains_prefix(new) == 0
        assert await get_fingerprints(backend, old) == expected(old)
        monkeypatch.undo()
        await put_keys(backend, later)
        assert await get_fingerprints(backend, later) == expected(later)

    run(scenario())


def chunk_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.kvc")}


OLD, NEW = chain(2, seed=1), chain(3, seed=2)


def test_a_read_only_folder_fails_puts_cleanly(tmp_path: Path) -> None:
    """EROFS from the kernel, for root too: a child sees the folder through a private read-only
    bind mount. Each put fails and is counted, at ``mkdir`` for a chunk whose folders are new and
    at the temporary file's ``open`` for one whose folders exist; the files on disk still read."""
    run(put_keys(make_backend(tmp_path), OLD))
    Path(nvme_files.chunk_path(str(tmp_path), NEW[0].digest, NEW[0].start)).parent.mkdir(parents=True)
    files = chunk_files(tmp_path)
    seen = run_with_mount(tmp_path, READ_ONLY, "tests.backends.test_nvme_faults", "puts_on_a_read_only_folder")
    assert seen == {"write_errors": len(NEW), "puts": 0, "failed": [[errno.EROFS, "mkdir"], [errno.EROFS, "open"]],
                    "new": 0, "old": expected(OLD)}
    assert chunk_files(tmp_path) == files and temp_files(tmp_path) == []


def puts_on_a_read_only_folder(root: str) -> dict[str, Any]:
    """Run by the child of the test above."""
    failures = record_write_failures()

    async def scenario() -> dict[str, Any]:
        backend = make_backend(root)
        await put_keys(backend, NEW)
        stats = backend.stats()
        return {"write_errors": stats["write_errors"], "puts": stats["puts"], "failed": sorted(set(failures.calls)),
                "new": await backend.contains_prefix(NEW), "old": await get_fingerprints(backend, OLD)}

    return run(scenario())


def test_the_start_up_scan_removes_strays_and_keeps_foreign_files(tmp_path: Path) -> None:
    keys = chain(4)
    run(put_keys(make_backend(tmp_path), keys))
    stray = file_of(tmp_path, keys[0]).with_name(nvme_files.TEMP_PREFIX + "deadbeef")
    stray.write_bytes(b"half a chunk")
    truncate(file_of(tmp_path, keys[1]))
    shutil.copyfile(file_of(tmp_path, keys[3]), file_of(tmp_path, keys[2]))  # misnamed
    foreign = file_of(tmp_path, keys[0]).with_name("notes.txt")
    foreign.write_text("not ours")

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        assert await get_fingerprints(backend, keys) == [expected(keys)[0], None, None, expected(keys)[3]]
        assert backend.stats()["scan_removed"] == 3
        assert backend.stats()["checksum_errors"] == 0, "bad files never reached a read"

    run(scenario())
    assert foreign.exists() and not stray.exists()
    assert len(list(tmp_path.rglob("*.kvc"))) == 2


def test_a_capacity_below_what_is_on_disk_evicts_at_start_up(tmp_path: Path) -> None:
    keys = chain(4)
    run(put_keys(make_backend(tmp_path), keys))
    size = file_of(tmp_path, keys[0]).stat().st_size

    async def scenario() -> None:
        backend = make_backend(tmp_path, nvme_capacity=2 * size)
        assert len(await backend.get_many([])) == 0
        assert backend.usage() == (2 * size, 2 * size) and backend.stats()["evictions"] == 2

    run(scenario())
    assert len(list(tmp_path.rglob("*.kvc"))) == 2


# --- a writer killed with SIGKILL ----------------------------------------------------------
BIG = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype=torch.float32, block_size=16)
BIG_CHUNK = 64  # 1 MiB chunks
BIG_KEYS = 300


def _write_slowly(fd: int, parts: Any) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, len(view), 1 << 16):
            os.write(fd, view[i : i + (1 << 16)])
            time.sleep(0.001)


async def write_forever(root: str) -> None:
    """Run by the child process: write BIG chunks in batches until killed.

    Each write stalls between 64 KiB pieces, so that the kill lands inside some of them.
    """
    nvme_files.write_parts = _write_slowly
    backend = make_backend(root, layout=BIG, chunk=BIG_CHUNK, staging_slots=1)
    keys = chain(BIG_KEYS, seed=3, layout=BIG, chunk=BIG_CHUNK)
    for i in range(0, len(keys), 8):
        await put_keys(backend, keys[i : i + 8], BIG)


def test_a_writer_killed_mid_write_leaves_only_whole_chunks(tmp_path: Path) -> None:
    child = run_child("import asyncio; from tests.backends.test_nvme_faults import write_forever; "
                      "asyncio.run(write_forever(sys.argv[1]))", str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while (len(list(tmp_path.rglob("*.kvc"))) < 12 or not temp_files(tmp_path)) \
                and time.monotonic() < deadline:
            assert child.poll() is None, "the writer ended before it was killed"
            time.sleep(0.005)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    whole = serde.HEADER_SIZE + BIG.chunk_bytes(BIG_CHUNK)
    assert all(p.stat().st_size == whole for p in tmp_path.rglob("*.kvc")), "a half chunk has a real name"
    strays = len(temp_files(tmp_path))
    assert strays > 0, "the kill should have caught a write half way"
    keys = chain(BIG_KEYS, seed=3, layout=BIG, chunk=BIG_CHUNK)

    async def scenario() -> int:
        backend = make_backend(tmp_path, layout=BIG, chunk=BIG_CHUNK, staging_slots=8)
        served = 0
        for i in range(0, len(keys), 8):
            for key, objs in zip(keys[i : i + 8], await backend.get_many(keys[i : i + 8])):
                if objs is not None:
                    assert fingerprint(objs) == expected([key], BIG)[0]
                    objs.release()
                    served += 1
        assert backend.stats()["scan_removed"] == strays
        assert backend.stats()["checksum_errors"] == 0
        return served

    assert run(scenario()) >= 12
    assert temp_files(tmp_path) == []
