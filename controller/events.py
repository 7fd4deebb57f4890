"""``EventBuffer``: tier admissions and evictions, in order, between the tiers and the agent.

The tiers report from kvlayer's I/O thread; the agent drains from its own. Only what is
reported while recording is kept (the agent records from just before it takes a snapshot,
so replaying the buffered events after the snapshot leaves every digest in its latest state).
Past ``limit`` buffered digests the buffer drops everything and flags ``overflowed``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvlayer.controller import controller_pb2 as pb


class EventBuffer:
    """A bounded, thread-safe, ordered log of (tier, admitted?, digests)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._items: list[tuple[str, bool, list[bytes]]] = []
        self._count = 0
        self._recording = False
        self.overflowed = False

    def record(self, on: bool) -> None:
        """Start (or stop) recording, from an empty buffer."""
        with self._lock:
            self._recording = on
            self._items, self._count = [], 0
            self.overflowed = False

    def add(self, tier: str, admitted: bool, digests: Sequence[bytes]) -> None:
        """Append one report (ignored when not recording); never blocks for long, never raises."""
        with self._lock:
            if not self._recording or self.overflowed:
                return
            if self._count + len(digests) > self._limit:
                self._items, self._count = [], 0
                self.overflowed = True
                return
            if self._items and self._items[-1][:2] == (tier, admitted):
                self._items[-1][2].extend(digests)
            else:
                self._items.append((tier, admitted, list(digests)))
            self._count += len(digests)

    def drain(self, batch: int) -> list[pb.TierEvent]:
        """Everything buffered, as events of at most ``batch`` digests, in order; the buffer empties."""
        with self._lock:
            items, self._items, self._count = self._items, [], 0
        out = []
        for tier, admitted, digests in items:
            for i in range(0, len(digests), batch):
                part = digests[i : i + batch]
                field = "admitted" if admitted else "evicted"
                out.append(pb.TierEvent(tier=tier, **{field: part}))
        return out
