"""An adapter's transfer counts, for the engine's own statistics (docs/architecture.md section 13).

``StepStats`` adds up what an adapter's lookups found and what its steps and async loads moved
(``StepCounts``); an engine that reports a connector's transfers as it runs (vLLM's connector
stats) takes the counts since its last call (``take``). Thread-safe: lookups may be counted on
other threads than the steps (vLLM's lookup channel answers on its own).
"""

from __future__ import annotations

import threading

from kvlayer.step import StepCounts
from kvlayer.windows import Found

STAT_NAMES = ("lookups", "lookup_hit_tokens", "loaded_tokens", "failed_load_tokens", "saved_chunks", "async_loads")
"""What ``StepStats`` counts."""


class StepStats:
    """Counts (``STAT_NAMES``) since the last ``take``, and ``totals`` since start-up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STAT_NAMES, 0)
        self.totals = dict.fromkeys(STAT_NAMES, 0)
        """The same counts since start-up (updated in place)."""

    def lookup(self, found: Found) -> None:
        """One lookup, and the tokens it found."""
        self._add(lookups=1, lookup_hit_tokens=found.num_tokens)

    def moved(self, counts: StepCounts, async_load: bool = False) -> None:
        """What one step's transfer, or (``async_load``) one async load, moved."""
        self._add(loaded_tokens=counts.loaded_tokens, failed_load_tokens=counts.wanted_tokens - counts.loaded_tokens,
                  saved_chunks=counts.saved_chunks, async_loads=int(async_load))

    def take(self) -> dict[str, int]:
        """The counts since the last call; {} if all are zero."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(STAT_NAMES, 0)
        return counts if any(counts.values()) else {}

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counts[name] += n
                self.totals[name] += n
