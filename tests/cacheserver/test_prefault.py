"""``kvlayer.cacheserver.prefault`` and ``pinned`` on real files: a mapping's data pages are made
resident before they are read (and only its data pages: the file's holes stay unallocated), a
registration is undone whoever stops first, and off CUDA the pinned path does nothing at all."""

from __future__ import annotations

import mmap
import os
import resource
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvlayer.cacheserver import pinned
from kvlayer.cacheserver.arena import shm_dir
from kvlayer.cacheserver.prefault import PIECE, Prefault

SIZE = 32 << 20
DATA_AT, DATA = 8 << 20, 8 << 20  # one data extent in a sparse file, as in a fresh arena
PAGE = mmap.PAGESIZE


@pytest.fixture
def sparse(tmp_path: Path) -> Iterator[str]:
    """A sparse file of ``SIZE`` bytes in the arena's folder with ``DATA`` bytes written at ``DATA_AT``."""
    path = shm_dir() / f"kvlayer-test-prefault-{os.getpid()}-{tmp_path.name}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        os.pwrite(fd, os.urandom(DATA), DATA_AT)
    finally:
        os.close(fd)
    yield str(path)
    path.unlink()


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)


def _faults_reading(view: memoryview) -> int:
    """Minor page faults this process takes to hash ``view`` once."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xxhash.xxh3_64_intdigest(view)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_the_data_pages_are_resident_before_the_first_read_and_the_holes_stay_holes(sparse):
    cold = _map(sparse)
    cold_faults = _faults_reading(memoryview(cold)[DATA_AT:DATA_AT + DATA])
    assert cold_faults >= DATA // (64 << 10)  # a fault per 4 KiB page, or per 64 KiB with fault-around
    allocated = _allocated(sparse)
    mapping = _map(sparse)
    prefault = Prefault(mapping, sparse, 4096).start()
    assert prefault.wait(10)
    assert prefault.populated == DATA and not prefault.registered
    assert _faults_reading(memoryview(mapping)[DATA_AT:DATA_AT + DATA]) < cold_faults // 10
    assert _allocated(sparse) == allocated  # populating a hole of tmpfs would have allocated it


def test_a_stopped_prefault_ends_within_a_piece(sparse):
    mapping = _map(sparse)
    prefault = Prefault(mapping, sparse, 0)
    prefault.stop()
    prefault.start()
    assert prefault.wait(10)
    assert prefault.populated == 0 < PIECE


class Registrations:
    """A stand-in for the CUDA registration (page-locking needs a GPU): counts the calls, and can
    hold ``register`` until ``release`` is set."""

    def __init__(self) -> None:
        self.registered = 0
        self.unregistered = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def register(self) -> bool:
        self.entered.set()
        assert self.release.wait(10)
        self.registered += 1
        return True

    def unregister(self) -> None:
        self.unregistered += 1


def test_a_registered_mapping_is_unregistered_once_by_whoever_stops_last(sparse):
    calls = Registrations()
    prefault = Prefault(_map(sparse), sparse, 0, calls.register, calls.unregister).start()
    assert prefault.wait(10) and prefault.registered and prefault.populated == 0  # pinning faults it in
    prefault.stop()
    prefault.stop()
    assert (calls.registered, calls.unregistered, prefault.registered) == (1, 1, False)

    late = Registrations()
    late.release.clear()
    prefault = Prefault(_map(sparse), sparse, 0, late.register, late.unregister).start()
    assert late.entered.wait(10)
    prefault.stop()  # while it registers: the thread undoes it when the registration returns
    assert late.unregistered == 0
    late.release.set()
    assert prefault.wait(10)
    assert (late.registered, late.unregistered, prefault.registered) == (1, 1, False)


def test_off_cuda_pinning_does_nothing_and_never_initialises_cuda(sparse):
    mapping = _map(sparse)
    address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    assert not pinned.wanted(torch.device("cpu"))
    assert not pinned.register(address, SIZE, torch.device("cpu"))
    if not torch.cuda.is_available():
        assert not pinned.wanted(torch.device("cuda"))
        assert not pinned.register(address, SIZE, torch.device("cuda"))
        assert not torch.cuda.is_initialized()
