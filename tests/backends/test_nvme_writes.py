"""The NVMe tier's write path (backends/nvme_files.py ``write_file``): the exact bytes land on disk,
encoded and written on one worker thread, short writes resumed, and a failed or cancelled
write leaves no file behind. Run: ``.venv/bin/python -m pytest tests/backends/test_nvme_writes.py``."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import KVCacheEngine, KVLayout, serde
from kvlayer.backends import nvme_files
from tests.backends.test_nvme import temp_files
from tests.kvlayer.test_transfer import BLOCK_SIZE, LAYERS, NUM_BLOCKS, bits, gathered, slots_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_store_leaves_the_exact_chunk_bytes_on_disk(tmp_path: Path, dtype: torch.dtype) -> None:
    """``KVCacheEngine.store`` to an NVMe-only engine: each file is the header of its key (shape,
    dtype, checksum of the payload), then the cache's KV at the chunk's slots, byte for byte."""
    layout = KVLayout(LAYERS, 2, 8, dtype, BLOCK_SIZE)
    caches = [bits(dtype, (2, NUM_BLOCKS, BLOCK_SIZE, 2, 8), seed=60 + i) for i in range(LAYERS)]
    slots = slots_of(61, 0, 96)
    tokens = list(range(500, 596))
    config = {"chunk_size": 32, "cpu_capacity": 0, "nvme_path": str(tmp_path)}
    with KVCacheEngine(config, layout, model_name="m") as eng:
        keys = eng.keys(tokens)
        assert eng.store(tokens, caches, slots) == 3
        assert eng.flush()
    for key in keys:
        data = Path(nvme_files.chunk_path(str(tmp_path), key.digest, key.start)).read_bytes()
        header = serde.decode_header(data[: serde.HEADER_SIZE])
        assert (header.key, header.tokens_digest) == (key.digest, key.tokens_digest)
        assert header.shape == layout.chunk_shape(32) and header.dtype == dtype and header.raw
        payload = data[serde.HEADER_SIZE :]
        assert len(payload) == header.payload_len == layout.chunk_bytes(32)
        assert header.payload_checksum == serde.payload_checksum(payload)
        want = gathered(caches, slots[key.start : key.end]).contiguous().view(-1).view(torch.uint8)
        assert payload == want.numpy().tobytes()
    assert temp_files(tmp_path) == []


def test_one_worker_thread_encodes_and_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``parts`` given as a function is called on the thread that writes (not the loop's), and a
    short ``writev`` is resumed where it stopped."""
    seen: dict[str, int] = {}
    real_writev = nvme_files.os.writev

    def short_writev(fd: int, buffers: Any) -> int:
        seen.setdefault("writev", threading.get_ident())
        return real_writev(fd, [memoryview(buffers[0])[:777]])  # at most 777 bytes a call

    def encode() -> tuple[bytes, memoryview]:
        seen["encode"] = threading.get_ident()
        return b"head" * 10, memoryview(bytes(range(256)) * 40)

    monkeypatch.setattr(nvme_files.os, "writev", short_writev)
    path = tmp_path / "a" / "b" / "chunk.kvc"
    asyncio.run(nvme_files.write_file(str(path), encode, fsync=True))
    assert path.read_bytes() == b"head" * 10 + bytes(range(256)) * 40
    assert seen["encode"] == seen["writev"] != threading.get_ident()
    assert temp_files(tmp_path) == []


def test_a_failed_encoding_leaves_no_file(tmp_path: Path) -> None:
    def encode() -> tuple[bytes, bytes]:
        raise ValueError("a chunk with NaN cannot be quantized")

    path = tmp_path / "x.kvc"
    with pytest.raises(ValueError, match="NaN"):
        asyncio.run(nvme_files.write_file(str(path), encode, fsync=False))
    assert not path.exists() and temp_files(tmp_path) == []


def test_a_cancelled_write_waits_for_its_thread_and_leaves_no_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while its thread writes: the call returns only once the thread is done (it reads
    the caller's memory), and neither the chunk's name nor a temporary file is left."""
    started, done = threading.Event(), threading.Event()

    def slow_write(fd: int, parts: Any) -> None:
        started.set()
        for part in parts:
            for i in range(0, len(part), 64):
                nvme_files.os.write(fd, memoryview(part)[i : i + 64])
                time.sleep(0.002)
        done.set()

    monkeypatch.setattr(nvme_files, "write_parts", slow_write)
    path = tmp_path / "c" / "chunk.kvc"

    async def scenario() -> None:
        task = asyncio.ensure_future(nvme_files.write_file(str(path), (b"h" * 64, b"p" * 1024), fsync=False))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set(), "the write's thread ended before the cancellation came out"

    asyncio.run(scenario())
    assert not path.exists()
    assert temp_files(tmp_path) == []


def test_blocks_are_reserved_up_front_where_the_filesystem_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fallocate`` failing for want of room fails the write before its first byte (no file
    left); failing because the filesystem cannot (EOPNOTSUPP) changes nothing."""
    calls: list[tuple[int, int]] = []

    def failing(code: int) -> Any:
        def fallocate(fd: int, mode: int, offset: int, length: int) -> int:
            calls.append((offset, length))
            ctypes.set_errno(code)
            return -1
        return fallocate

    fine, full = tmp_path / "fine.kvc", tmp_path / "full.kvc"
    monkeypatch.setattr(nvme_files, "_fallocate", lambda: failing(errno.EOPNOTSUPP))
    asyncio.run(nvme_files.write_file(str(fine), (b"head", memoryview(b"payload")), fsync=False))
    assert fine.read_bytes() == b"headpayload" and calls == [(0, 11)], "the whole file, at once"
    monkeypatch.setattr(nvme_files, "_fallocate", lambda: failing(errno.ENOSPC))
    with pytest.raises(OSError) as err:
        asyncio.run(nvme_files.write_file(str(full), (b"head", b"payload"), fsync=False))
    assert err.value.errno == errno.ENOSPC
    assert not full.exists() and temp_files(tmp_path) == []
    monkeypatch.undo()
    if nvme_files._fallocate() is not None:  # the real call on this filesystem: an exact file
        asyncio.run(nvme_files.write_file(str(full), (b"x" * 5000,), fsync=False))
        assert full.read_bytes() == b"x" * 5000
