"""Tests of the NVMe tier (backends/nvme.py): round trips, file layout, warm restarts, the index.

Run: ``.venv/bin/python -m pytest tests/backends/test_nvme*.py``. Eviction lives in
``test_nvme_eviction.py``, staging memory and cancellation in ``test_nvme_staging.py``, fault
injection in ``test_nvme_faults.py``; they reuse the helpers defined here (as do the child
processes and the layer-group read tests); chunk contents and keys come from ``tests/fakes.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvlayer import serde
from kvlayer.backends import nvme_files
from kvlayer.backends.nvme import NvmeBackend
from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext
from tests.fakes import chunk_data, make_chunk, make_keys, namespace

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
CHUNK = 16
ROOT = str(Path(__file__).parents[2])
"""The repository root: child processes import ``tests.backends.*`` from it."""


# --- helpers (also used by the other test_nvme*.py and the child processes) --------------
def make_ctx(root: Path | str, layout: KVLayout = LAYOUT, chunk: int = CHUNK, staging_slots: int = 64,
             **config: Any) -> BackendContext:
    """A context whose nvme tier lives at ``root``, with a staging arena of ``staging_slots``."""
    cfg = KVLayerConfig(chunk_size=chunk, nvme_path=str(root), **config)
    slot = layout.chunk_bytes(chunk)
    return BackendContext(cfg, layout, torch.device("cpu"), Arena(staging_slots * slot, slot))


def make_backend(root: Path | str, **kw: Any) -> NvmeBackend:
    backend = NvmeBackend.create(make_ctx(root, **kw))
    assert isinstance(backend, NvmeBackend)
    return backend


def chain(n: int, seed: int = 0, layout: KVLayout = LAYOUT, chunk: int = CHUNK) -> list[ChunkKey]:
    """A prefix chain of ``n`` full chunks of random tokens (``seed`` picks the tokens)."""
    return make_keys(n, seed, namespace(chunk_size=chunk, layout=layout))


def fingerprint(obj: MemoryObj | torch.Tensor | None) -> str | None:
    """A digest of a chunk's bytes (None stays None)."""
    if obj is None:
        return None
    tensor = obj.tensor if isinstance(obj, MemoryObj) else obj
    return xxhash.xxh3_128_hexdigest(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def expected(keys: list[ChunkKey], layout: KVLayout = LAYOUT) -> list[str | None]:
    """The fingerprints an exact read of ``keys`` gives."""
    return [fingerprint(chunk_data(k, layout)) for k in keys]


async def put_keys(backend: NvmeBackend, keys: list[ChunkKey], layout: KVLayout = LAYOUT) -> None:
    """Put the chunks of ``keys`` (made in an arena of their own, released afterwards)."""
    slot = layout.chunk_bytes(keys[0].num_tokens)
    src = Arena(len(keys) * slot, slot)
    chunks = [make_chunk(src, k, layout) for k in keys]
    try:
        await backend.put_many(keys, chunks)
    finally:
        for c in chunks:
            c.release()


async def get_fingerprints(backend: NvmeBackend, keys: list[ChunkKey]) -> list[str | None]:
    """Fingerprints of the chunks read back (None for misses); releases what it read."""
    objs = await backend.get_many(keys)
    prints = [fingerprint(o) for o in objs]
    for o in objs:
        if o is not None:
            o.release()
    return prints


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob(nvme_files.TEMP_PREFIX + "*"))


def run_child(code: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    """A Python process running ``code`` with the repository importable and ``args`` in argv."""
    return subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); {code}",
                             *args], cwd=ROOT, text=True, **popen)


async def read_back(root: str, n: int, seed: int) -> dict[str, Any]:
    """What a fresh backend on ``root`` holds of chain ``seed`` (run by the child process)."""
    backend = make_backend(root)
    keys = chain(n, seed)
    return {"prefix": await backend.contains_prefix(keys), "prints": await get_fingerprints(backend, keys)}


# --- tests ----------------------------------------------------------------------------------
def test_create_needs_a_path_and_a_capacity(tmp_path: Path) -> None:
    base = make_ctx(tmp_path)
    assert NvmeBackend.create(base) is not None
    for change in ({"nvme_path": None}, {"nvme_capacity": 0}):
        ctx = BackendContext(base.config.replace(**change), LAYOUT, base.device, base.staging)
        assert NvmeBackend.create(ctx) is None
    assert not any(tmp_path.iterdir()), "create() must not touch the disk"


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_round_trip_is_exact(tmp_path: Path, compression: str) -> None:
    keys = chain(6)

    async def scenario() -> None:
        backend = make_backend(tmp_path, compression=compression)
        await put_keys(backend, keys[:5])
        assert await get_fingerprints(backend, keys) == expected(keys[:5]) + [None]
        stats = backend.stats()
        assert (stats["puts"], stats["hits"], stats["misses"], stats["chunks"]) == (5, 5, 1, 5)
        assert backend._staging.used_count == 0

    run(scenario())
    head = serde.decode_header(next(tmp_path.rglob("*.kvc")).read_bytes())
    assert head.compression == serde.COMPRESSION_CODES[compression]


def test_lz4_shrinks_compressible_chunks(tmp_path: Path) -> None:
    key = chain(1)[0]

    async def scenario() -> None:
        backend = make_backend(tmp_path, compression="lz4")
        src = Arena(LAYOUT.chunk_bytes(CHUNK), LAYOUT.chunk_bytes(CHUNK))
        with src.allocate(LAYOUT.chunk_shape(CHUNK), LAYOUT.dtype) as zeros:
            zeros.tensor.zero_()
            await backend.put_many([key], [zeros])
            (got,) = await backend.get_many([key])
            assert got is not None and bytes(got.byte_view()) == bytes(zeros.byte_view())
            got.release()

    run(scenario())
    assert next(tmp_path.rglob("*.kvc")).stat().st_size < LAYOUT.chunk_bytes(CHUNK) // 4


def test_file_layout_sharded_with_header_first(tmp_path: Path) -> None:
    keys = chain(3)
    run(put_keys(make_backend(tmp_path), keys))
    for key in keys:
        hx = key.hex
        path = tmp_path / hx[:2] / hx[2:4] / f"{hx}-{key.start}.kvc"
        data = path.read_bytes()
        assert len(data) == serde.HEADER_SIZE + LAYOUT.chunk_bytes(CHUNK)
        assert data[:4] == serde.MAGIC
        assert data[8:40] == key.digest and data[40:56] == key.tokens_digest
    assert len(list(tmp_path.rglob("*.kvc"))) == 3
    assert temp_files(tmp_path) == []


def test_put_of_a_present_key_is_a_no_op(tmp_path: Path) -> None:
    keys = chain(2)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await put_keys(backend, keys)
        path = next(tmp_path.rglob("*.kvc"))
        before = path.stat().st_mtime_ns
        await put_keys(backend, keys + keys)
        assert path.stat().st_mtime_ns == before
        assert backend.stats()["puts"] == 2

    run(scenario())


def test_warm_restart_in_process(tmp_path: Path) -> None:
    keys = chain(4)

    async def scenario() -> None:
        first = make_backend(tmp_path)
        await put_keys(first, keys)
        used = first.usage()
        await first.close()
        second = make_backend(tmp_path)
        assert await second.contains_prefix(keys) == 4
        assert sorted(second.keys()) == sorted(k.digest for k in keys)
        assert second.usage() == used
        assert await get_fingerprints(second, keys) == expected(keys)

    run(scenario())


def test_warm_restart_in_another_process(tmp_path: Path) -> None:
    keys = chain(5, seed=7)
    run(put_keys(make_backend(tmp_path), keys))
    child = run_child("import asyncio, json; from tests.backends.test_nvme import read_back; "
                      "print(json.dumps(asyncio.run(read_back(sys.argv[1], 5, 7))))",
                      str(tmp_path), stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"prefix": 5, "prints": expected(keys)}


def test_contains_prefix_reads_only_the_index(tmp_path: Path) -> None:
    keys = chain(5)

    async def scenario() -> None:
        backend = make_backend(tmp_path)
        assert await backend.contains_prefix(keys) == 0
        await put_keys(backend, keys[:3])
        assert await backend.contains_prefix(keys) == 3
        await put_keys(backend, keys[4:])
        assert await backend.contains_prefix(keys) == 3
        assert await backend.contains_prefix(keys[4:]) == 1
        assert await backend.contains_prefix([]) == 0
        for path in tmp_path.rglob("*.kvc"):
            path.unlink()
        assert await backend.contains_prefix(keys) == 3, "no I/O: a file deleted behind it is unseen"

    run(scenario())


def test_the_closed_backend_refuses_calls(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = make_backend(tmp_path)
        await backend.close()
        with pytest.raises(RuntimeError):
            await backend.contains_prefix(chain(1))

    run(scenario())
    assert os.path.isdir(tmp_path)
