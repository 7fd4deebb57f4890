"""Staging memory in the NVMe tier (backends/nvme.py, backends/nvme_reads.py): a full staging
arena, and reads and puts cancelled in flight, which must neither leak a slot nor hand one out
again while a worker thread still writes into it.

Run: ``.venv/bin/python -m pytest tests/backends/test_nvme_staging.py``. The helpers come from
``test_nvme.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kvlayer.backends import nvme_files
from kvlayer.memory import Arena
from tests.backends.test_nvme import (
    CHUNK,
    LAYOUT,
    chain,
    expected,
    fingerprint,
    get_fingerprints,
    make_backend,
    put_keys,
    run,
    temp_files,
)
from tests.fakes import make_chunk


def test_a_full_staging_arena_turns_reads_into_counted_misses(tmp_path: Path) -> None:
    keys = chain(6)

    async def scenario() -> None:
        backend = make_backend(tmp_path, staging_slots=4)
        await put_keys(backend, keys)
        objs = await backend.get_many(keys)
        served = [o for o in objs if o is not None]
        assert len(served) == 4 and backend.stats()["staging_full"] == 2
        want = dict(zip(expected(keys), keys))
        assert all(fingerprint(o) in want for o in served)
        for o in served:
            o.release()
        assert backend._staging.used_count == 0

    run(scenario())


def test_cancelled_reads_leak_no_staging_memory(tmp_path: Path) -> None:
    keys = chain(12)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        for delay in (0, 0.0005, 0.001, 0.002, 0.005):
            try:
                objs = await asyncio.wait_for(backend.get_many(keys), delay)
            except TimeoutError:
                continue
            for o in objs:
                if o is not None:
                    o.release()
        for _ in range(200):  # reads cancelled in flight free their slots when their threads end
            if backend._staging.used_count == 0:
                break
            await asyncio.sleep(0.01)
        assert backend._staging.used_count == 0
        assert await get_fingerprints(backend, keys) == expected(keys)

    run(scenario())


def test_a_read_cancelled_in_flight_frees_its_slot_only_when_the_thread_is_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain(2)
    real_read_into = nvme_files.read_into

    def slow_read_into(path: str, buffers: Any) -> int:
        time.sleep(0.2)
        return real_read_into(path, buffers)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        monkeypatch.setattr(nvme_files, "read_into", slow_read_into)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(backend.get_many(keys), 0.05)
        assert backend._staging.used_count == 2, "the threads still write into their slots"
        await asyncio.sleep(0.4)
        assert backend._staging.used_count == 0
        monkeypatch.undo()
        assert await get_fingerprints(backend, keys) == expected(keys)

    run(scenario())


def test_cancelled_puts_finish_in_the_background_and_hold_their_chunks(tmp_path: Path) -> None:
    keys = chain(12)
    slot = LAYOUT.chunk_bytes(CHUNK)
    src = Arena(len(keys) * slot, slot)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        chunks = [make_chunk(src, k, LAYOUT) for k in keys]
        put = asyncio.ensure_future(backend.put_many(keys, chunks))
        while not backend._writes:  # until the writes have started
            await asyncio.sleep(0)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        for c in chunks:
            c.release()  # the writes still in flight hold references of their own
        await backend.close()
        assert src.used_count == 0
        assert await get_fingerprints(make_backend(tmp_path), keys) == expected(keys)

    run(scenario())
    assert temp_files(tmp_path) == []
