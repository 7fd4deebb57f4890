"""A real full disk under the NVMe tier: a tiny tmpfs in a private mount namespace
(``tests/backends/private_mount.py``) that runs out of bytes or of inodes under a
``KVCacheEngine`` with a CPU tier above the NVMe one (``nvme_fsync`` on).

Each way a chunk's write meets ENOSPC from the kernel: the block reservation (``fallocate``),
the write itself half way (a filesystem without ``fallocate``), the chunk's folder (``mkdir``)
and its temporary file (``open``) for want of an inode. Every time: the store still returns,
each failed write is one ``write_errors`` count, no temporary file or space is left behind, the
CPU tier still serves the new chunks exactly, the chunk files already on disk are untouched and
read back exactly, the tier stays healthy, and once there is room again the same chunks are
written and read back. (tmpfs cannot fail an ``fsync`` or a rename: those faults are injected
in ``test_nvme_faults.py``.)

Run: ``.venv/bin/python -m pytest tests/backends/test_disk_full.py`` (as root, or a user allowed
``unshare -r -m``; skips elsewhere). One child process runs every case, each on its own tmpfs.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import KVCacheEngine, KVLayout
from kvlayer.backends import nvme_files
from kvlayer.keys import ChunkKey
from tests.backends.private_mount import (
    WriteFailures,
    fill_up,
    free_bytes,
    record_write_failures,
    run_with_mount,
    tmpfs,
    use_up_inodes,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
CHUNK = 16  # 8 KiB chunks: three pages of tmpfs with their header
NUM_BLOCKS = 64
OLD, NEW = list(range(1000, 1048)), list(range(2000, 2048))  # three chunks each
CONFIG = {"chunk_size": CHUNK, "cpu_capacity": "1MiB", "staging_capacity": "1MiB", "nvme_fsync": True}
PAGE = 4096

# --- the cases: how to fill the disk (given the folder and the new chunks' keys), how to free it
Fill = Callable[[Path, list[ChunkKey]], None]


def no_bytes(root: Path, keys: list[ChunkKey]) -> None:
    """Fill the filesystem, then free one page: a chunk (three pages) cannot fit."""
    filler = root / "filler"
    size = fill_up(filler)
    with open(filler, "r+b") as f:
        f.truncate(size - PAGE)


def no_inodes(root: Path, keys: list[ChunkKey]) -> None:
    use_up_inodes(root)


def no_inodes_but_folders(root: Path, keys: list[ChunkKey]) -> None:
    """The new chunks' folders made first: only their files lack an inode."""
    for key in keys:
        Path(nvme_files.chunk_path(str(root / "kv"), key.digest, key.start)).parent.mkdir(parents=True, exist_ok=True)
    use_up_inodes(root)


def free(root: Path) -> None:
    for p in root.iterdir():
        if p.name != "kv":
            p.unlink()


CASES: dict[str, tuple[str, Fill, bool, str]] = {  # mount, fill, preallocate, the call that fails
    "no room for the blocks": (tmpfs("256k"), no_bytes, True, "fallocate"),
    "no room half way through the write": (tmpfs("256k"), no_bytes, False, "write"),
    "no inode for the folder": (tmpfs("256k", inodes=64), no_inodes, True, "mkdir"),
    "no inode for the file": (tmpfs("256k", inodes=64), no_inodes_but_folders, True, "open"),
}


# --- the child: every case on a tmpfs of its own under the root it was given ----------------------
def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=gen) for _ in range(LAYOUT.num_layers)]


def slots(seed: int, n: int) -> torch.Tensor:
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[: -(-n // 4)]
    return (blocks[:, None] * LAYOUT.block_size + torch.arange(LAYOUT.block_size)).view(-1)[:n]


def kv_at(cs: list[torch.Tensor], at: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.view(2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:, at] for c in cs])


def read_back(eng: KVCacheEngine, tokens: list[int], src: list[torch.Tensor], at: torch.Tensor) -> dict[str, Any]:
    """Where the engine finds ``tokens``, how many it loads into empty caches, and whether exactly."""
    found = eng.lookup(tokens)
    dst = [torch.zeros_like(c) for c in src]
    n = eng.retrieve(tokens, dst, at)
    return {"tiers": sorted({eng.tier_names[s] for s in found.sources}), "loaded": n,
            "exact": bool(torch.equal(kv_at(dst, at[:n]), kv_at(src, at[:n])))}


def on_disk(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def one_case(root: Path, fill: Fill, preallocate: bool, failures: WriteFailures) -> dict[str, Any]:
    """Store OLD, fill the disk, store NEW, look at everything, free the disk, store NEW again."""
    kv = root / "kv"
    src, at = caches(1), slots(2, len(OLD))
    new_src, new_at = caches(3), slots(4, len(NEW))
    real_fallocate = nvme_files._fallocate
    if not preallocate:
        nvme_files._fallocate = lambda: None  # type: ignore[assignment] # as on a filesystem without it
    try:
        with KVCacheEngine({**CONFIG, "nvme_path": str(kv)}, LAYOUT, model_name="m") as eng:
            out: dict[str, Any] = {}
            eng.store(OLD, src, at)
            assert eng.flush()
            files = on_disk(kv)
            fill(root, eng.keys(NEW))
            room = free_bytes(root)
            out["stored while full"] = eng.store(NEW, new_src, new_at)
            assert eng.flush()
            nvme = eng.stats()["tiers"]["nvme"]
            out["failed writes"] = sorted(set(failures.calls))
            out["most bytes written by a failed write"] = max(failures.bytes_written, default=0)
            out["write_errors"], out["puts"] = nvme["backend"]["write_errors"], nvme["backend"]["puts"]
            out["healthy"] = nvme["health"]["healthy"]
            out["bytes left behind"] = room - free_bytes(root)
            out["files unchanged"] = on_disk(kv) == files
            out["new, while full"] = read_back(eng, NEW, new_src, new_at)
            eng.evict_all("cpu")
            out["old, from disk"] = read_back(eng, OLD, src, at)
            out["new, from disk"] = read_back(eng, NEW, new_src, new_at)
            free(root)
            failures.clear()
            eng.store(NEW, new_src, new_at)
            assert eng.flush()
            eng.evict_all("cpu")
            out["new, once freed"] = read_back(eng, NEW, new_src, new_at)
            backend = eng.stats()["tiers"]["nvme"]["backend"]
            out["once freed"] = {"write_errors": backend["write_errors"], "puts": backend["puts"],
                                 "failed writes": failures.calls[:]}
            out["temporary files"] = [p.name for p in kv.rglob(nvme_files.TEMP_PREFIX + "*")]
            return out
    finally:
        nvme_files._fallocate = real_fallocate


def every_case(root: str) -> dict[str, Any]:
    """Run in the child: each case on a tmpfs mounted at ``root/<case number>``."""
    failures = record_write_failures()
    results = {}
    for i, (name, (mount, fill, preallocate, _)) in enumerate(CASES.items()):
        folder = Path(root) / str(i)
        folder.mkdir()
        subprocess.run(["sh", "-c", mount], env={**os.environ, "DIR": str(folder)}, check=True)
        failures.clear()
        results[name] = one_case(folder, fill, preallocate, failures)
    return results


# --- the tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("disk-full")
    return run_with_mount(root, tmpfs("4m"), "tests.backends.test_disk_full", "every_case")


@pytest.mark.parametrize("case", CASES)
def test_a_full_disk_fails_writes_cleanly_and_loses_nothing(results: dict[str, Any], case: str) -> None:
    fails_at = CASES[case][3]
    want_new_from_cpu = {"tiers": ["cpu"], "loaded": len(NEW), "exact": True}
    assert results[case] == {
        "stored while full": 3,  # handed to the tiers: the CPU tier took them
        "failed writes": [[errno.ENOSPC, fails_at]],  # every one of them
        "most bytes written by a failed write": PAGE if fails_at == "write" else 0,  # reserved up front
        "write_errors": 3,
        "puts": 3,  # OLD's chunks only
        "healthy": True,
        "bytes left behind": 0,
        "files unchanged": True,
        "new, while full": want_new_from_cpu,
        "old, from disk": {"tiers": ["nvme"], "loaded": len(OLD), "exact": True},
        "new, from disk": {"tiers": [], "loaded": 0, "exact": True},
        "new, once freed": {"tiers": ["nvme"], "loaded": len(NEW), "exact": True},
        "once freed": {"write_errors": 3, "puts": 6, "failed writes": []},
        "temporary files": [],
    }
