"""Tier health: when to stop calling a failing tier, and when to try it again.

``TierHealth`` is a small state machine (docs/architecture.md section 5, failures):

- healthy: every call goes through; ``unhealthy_after`` consecutive failures make it unhealthy.
- unhealthy: calls are skipped until the backoff expires (by default 1 s, doubling up to 30 s;
  ``unhealthy_backoff_ms``/``unhealthy_backoff_max_ms`` in the config); then
  calls go through again as probes. A failed probe doubles the backoff; any success makes
  the tier healthy again and resets the backoff.

``LogThrottle`` lets one line through per interval, so a failing tier logs once, not per chunk.
Both take an injectable ``clock`` (seconds, monotonic) for tests, and are thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]


class TierHealth:
    """Consecutive-failure counting with exponential backoff for one tier."""

    def __init__(self, unhealthy_after: int, base_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 clock: Clock = time.monotonic) -> None:
        if unhealthy_after <= 0:
            raise ValueError(f"unhealthy_after must be positive, got {unhealthy_after}")
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < base_backoff_s <= max_backoff_s, got {base_backoff_s} and {max_backoff_s}"
            )
        self._after = unhealthy_after
        self._base = base_backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._healthy = True
        self._backoff = 0.0
        self._retry_at = 0.0

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def backoff_s(self) -> float:
        """The current backoff (0 while healthy)."""
        return self._backoff

    def available(self) -> bool:
        """True if a call may go to the tier now: it is healthy, or its backoff has expired (a probe)."""
        with self._lock:
            return self._healthy or self._clock() >= self._retry_at

    def retry_in(self) -> float:
        """Seconds until the next probe is allowed (0 when calls may go through now)."""
        with self._lock:
            return 0.0 if self._healthy else max(0.0, self._retry_at - self._clock())

    def record_success(self) -> bool:
        """Note a successful call; returns True if this made an unhealthy tier healthy again."""
        with self._lock:
            recovered = not self._healthy
            self._failures = 0
            self._healthy = True
            self._backoff = 0.0
            return recovered

    def record_failure(self) -> bool:
        """Note a failed call; returns True if this made the tier unhealthy (not for later failures)."""
        with self._lock:
            self._failures += 1
            now = self._clock()
            if self._healthy:
                if self._failures < self._after:
                    return False
                self._healthy = False
                self._backoff = self._base
                self._retry_at = now + self._backoff
                return True
            if now >= self._retry_at:  # a probe failed; failures of calls begun earlier don't count
                self._backoff = min(self._backoff * 2, self._max)
                self._retry_at = now + self._backoff
            return False

    def snapshot(self) -> dict[str, float | int | bool]:
        """Plain data: healthy, consecutive_failures, backoff_s, retry_in_s."""
        return {"healthy": self._healthy, "consecutive_failures": self._failures,
                "backoff_s": self._backoff, "retry_in_s": self.retry_in()}


class LogThrottle:
    """``allow()`` is True at most once per ``interval_s`` (the first call always passes)."""

    def __init__(self, interval_s: float = 30.0, clock: Clock = time.monotonic) -> None:
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next = float("-inf")
        self._suppressed = 0
        self.last_suppressed = 0
        """How many calls were refused between the last two allowed ones (for "N more" in a line)."""

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._suppressed += 1
                return False
            self._next = now + self._interval
            self.last_suppressed, self._suppressed = self._suppressed, 0
            return True
