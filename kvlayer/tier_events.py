"""kvlayer's tier events: what enters and leaves the tiers, with the chunks' tokens (docs/vllm.md, "KV-cache events").

An engine adapter that publishes KV-cache events (vLLM's worker side today) listens to its
tiers (``kvlayer.storage.TierListener``, ``TierEvents``): a chunk entering a tier is a
``Stored`` record, one leaving it (evicted, removed, dropped as corrupt) a ``Removed`` one. An
event such as vLLM's ``BlockStored`` carries the chunk's token ids, which a tier does not know,
so the adapter ``remember``s the tokens of the chunks a step saves or loads
(``StepCounts.moved``); a chunk entering a tier that it does not remember (NVMe files found at
start-up, say) is not announced, only counted (``unannounced``). ``connectors/vllm_v1.py``
turns the records into vLLM's events; this module imports no engine.

The listener is called on the tiers' I/O loop thread: it only appends under a lock, never
raises (a failure is logged once and counted in ``dropped``), and passes every call on to the
listener it wraps (the controller agent, which listens to the same tiers).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlayer.keys import ChunkKey
    from kvlayer.storage import TierListener

log = logging.getLogger(__name__)

KNOWN_CHUNKS = 4096
"""How many chunks' tokens are remembered (the most recently saved or loaded): a chunk is
announced when it enters a tier, which for NVMe and Redis is a background write after the save."""

MAX_PENDING = 65536
"""Records kept between two ``take``s; past it the oldest are dropped (counted)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Chunks ``digests`` entered tier ``tier``. They are a chain: each one's predecessor in its
    token sequence is the one before it, and the first one's is ``parent`` (None at the start of
    the sequence). ``token_ids`` are the chunks' tokens, in order."""

    tier: str
    digests: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    """Chunks ``digests`` left tier ``tier`` (evicted, removed, or dropped as corrupt)."""

    tier: str
    digests: tuple[bytes, ...]


TierEvent = Stored | Removed


class TierEvents:
    """A ``TierListener`` that records what enters and leaves the tiers, until ``take``;
    ``then`` is a listener every call is passed on to (or None)."""

    def __init__(self, then: TierListener | None = None, known: int = KNOWN_CHUNKS,
                 pending: int = MAX_PENDING) -> None:
        self._then = then
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        self._known_max = known
        self._pending: deque[TierEvent] = deque()
        self._pending_max = pending
        self.unannounced = 0
        """Chunks that entered a tier whose tokens were not remembered (no event)."""
        self.dropped = 0
        """Records dropped past ``pending``, plus the calls here that failed (their records lost)."""

    def remember(self, keys: Sequence[ChunkKey], token_ids: Sequence[int], first: int = 0) -> None:
        """The tokens of ``keys`` that start at token ``first`` or later, so that their entering a
        tier is announced. ``keys`` are a sequence's chunk keys from its first chunk on, over
        ``token_ids`` (the keys before ``first`` give the parents). Never raises (a failure is
        counted in ``dropped``)."""
        try:
            entries = [(k.digest, (keys[i - 1].digest if i else None, tuple(token_ids[k.start : k.end])))
                       for i, k in enumerate(keys) if k.start >= first]
            with self._lock:
                for digest, entry in entries:
                    self._known[digest] = entry
                    self._known.move_to_end(digest)
                while len(self._known) > self._known_max:
                    self._known.popitem(last=False)
        except Exception:
            self._lost("kvlayer: remembering chunks' tokens failed; they are not announced",
                       exc_info=True)

    def on_admit(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks entered ``tier``."""
        try:
            with self._lock:
                for digest in digests:
                    entry = self._known.get(digest)
                    if entry is None:
                        self.unannounced += 1
                    else:
                        self._push(Stored(tier, (digest,), entry[0], entry[1]))
        except Exception:
            self._lost("kvlayer: recording a tier event failed; it is dropped", exc_info=True)
        if self._then is not None:
            self._then.on_admit(tier, digests)

    def on_evict(self, tier: str, digests: Sequence[bytes]) -> None:
        """``TierListener``: chunks left ``tier``."""
        try:
            with self._lock:
                self._push(Removed(tier, tuple(digests)))
        except Exception:
            self._lost("kvlayer: recording a tier event failed; it is dropped", exc_info=True)
        if self._then is not None:
            self._then.on_evict(tier, digests)

    def take(self) -> list[TierEvent]:
        """The records since the last call, in order, runs merged (``merge_runs``)."""
        with self._lock:
            records, self._pending = list(self._pending), deque()
        return merge_runs(records)

    def _push(self, record: TierEvent) -> None:
        self._pending.append(record)
        if len(self._pending) > self._pending_max:
            self._pending.popleft()
            self._lost("kvlayer: more than %d tier events between two steps; the oldest are dropped",
                       self._pending_max)

    def _lost(self, msg: str, *args: object, exc_info: bool = False) -> None:
        """Count one loss; the first one is logged as a warning, later ones at debug level."""
        level = logging.DEBUG if self.dropped else logging.WARNING
        self.dropped += 1
        log.log(level, msg, *args, exc_info=exc_info)


def merge_runs(records: Sequence[TierEvent]) -> list[TierEvent]:
    """``records`` with each run of consecutive records of one tier merged into one record:
    ``Stored`` ones where each continues the chain of the one before (its parent is that one's
    last digest), ``Removed`` ones always. The order is kept."""
    out: list[TierEvent] = []
    run: list[TierEvent] = []
    for rec in records:
        if run and not _continues(run[-1], rec):
            out.append(_merged(run))
            run = []
        run.append(rec)
    if run:
        out.append(_merged(run))
    return out


def _continues(last: TierEvent, rec: TierEvent) -> bool:
    if last.tier != rec.tier:
        return False
    if isinstance(rec, Stored):
        return isinstance(last, Stored) and rec.parent is not None and rec.parent == last.digests[-1]
    return isinstance(last, Removed)


def _merged(run: Sequence[TierEvent]) -> TierEvent:
    """One record for a run that ``_continues`` record by record."""
    first = run[0]
    if len(run) == 1:
        return first
    digests = tuple(d for r in run for d in r.digests)
    if isinstance(first, Stored):
        tokens = tuple(t for r in run if isinstance(r, Stored) for t in r.token_ids)
        return Stored(first.tier, digests, first.parent, tokens)
    return Removed(first.tier, digests)
