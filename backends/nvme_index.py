"""The NVMe tier's in-memory index: which chunk files exist, in LRU order, within a byte budget.

Pure bookkeeping, no I/O: the backend (``backends/nvme.py``) unlinks the files of the
entries this index hands back as victims. Only the backend's I/O loop touches it, so it has
no lock.

Eviction: least recently used first, never a pinned entry nor one being read, and among the
``EVICT_WINDOW`` oldest candidates the one with the largest ``start`` first. The chunks of
one prefix chain are stored and read together, so they sit next to each other in LRU order;
taking the largest start within that window drops a chain's tail before its head (a chunk
whose predecessor is gone can never be hit).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

EVICT_WINDOW = 8
"""How many of the oldest evictable entries compete on ``start`` for eviction."""


@dataclass(slots=True)
class IndexEntry:
    """One chunk file: ``size`` bytes on disk at ``path``, holding tokens from ``start``.

    ``pins`` counts ``pin`` calls not yet undone; ``readers`` counts reads in flight. Either
    keeps the entry from eviction.
    """

    digest: bytes
    path: str
    size: int
    start: int
    pins: int = 0
    readers: int = 0

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and self.readers == 0


class NvmeIndex:
    """digest -> ``IndexEntry``, oldest use first, bounded by ``capacity`` bytes of files.

    ``reserve`` sets bytes aside for a file being written, so concurrent writes cannot
    overshoot the capacity together; every reservation is undone with ``unreserve``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, IndexEntry] = OrderedDict()
        self._used = 0
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._lru

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed files (reservations not included)."""
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes set aside for files being written."""
        return self._reserved

    def digests(self) -> list[bytes]:
        return list(self._lru)

    def get(self, digest: bytes) -> IndexEntry | None:
        return self._lru.get(digest)

    def touch(self, digest: bytes) -> None:
        """Mark ``digest`` as just used (no-op when absent)."""
        if digest in self._lru:
            self._lru.move_to_end(digest)

    def add(self, entry: IndexEntry) -> None:
        """Insert ``entry`` as the most recently used; its digest must be absent."""
        if entry.digest in self._lru:
            raise KeyError(f"{entry.digest.hex()[:16]} is already indexed")
        self._lru[entry.digest] = entry
        self._used += entry.size

    def pop(self, digest: bytes) -> IndexEntry | None:
        """Remove and return the entry of ``digest`` (None when absent)."""
        entry = self._lru.pop(digest, None)
        if entry is not None:
            self._used -= entry.size
        return entry

    def reserve(self, size: int) -> list[IndexEntry] | None:
        """Set ``size`` bytes aside, evicting as needed; returns the evicted entries.

        None (and nothing evicted or reserved) when pinned and busy entries leave too little
        room. The caller deletes the victims' files.
        """
        victims = self.make_room(size)
        if victims is not None:
            self._reserved += size
        return victims

    def unreserve(self, size: int) -> None:
        """Undo one ``reserve(size)``, after the write it was for succeeded or failed."""
        if size > self._reserved:
            raise ValueError(f"unreserve({size}) exceeds the {self._reserved} bytes reserved")
        self._reserved -= size

    def make_room(self, size: int) -> list[IndexEntry] | None:
        """Evict until ``size`` more bytes fit; the evicted entries, or None if they cannot."""
        need = self._used + self._reserved + size - self.capacity
        if need <= 0:
            return []
        victims = self._pick_victims(need)
        if victims is None:
            return None
        for v in victims:
            self.pop(v.digest)
        return victims

    def _pick_victims(self, need: int) -> list[IndexEntry] | None:
        candidates: Iterator[IndexEntry] = (e for e in self._lru.values() if e.evictable)
        window = list(itertools.islice(candidates, EVICT_WINDOW))
        chosen: list[IndexEntry] = []
        freed = 0
        while freed < need and window:
            victim = max(window, key=lambda e: e.start)  # ties: the oldest, listed first
            window.remove(victim)
            window.extend(itertools.islice(candidates, 1))
            chosen.append(victim)
            freed += victim.size
        return chosen if freed >= need else None
