"""Why the router routes as it does, for ``/health``, and its fall-back warnings, rate limited.

``RoutingStatus`` remembers how the last request was routed: by the controller's prefix lookup
(``mode`` "kv"), or by load and why (``by_load``: no lookup could be asked, e.g. a chat prompt
without ``--tokenizer``; ``lookup_failed``: the controller refused it, was too slow or is
down), or by another policy (``mode`` is the policy's name). ``/health`` shows it, and says
"controller unreachable" while the controller does not answer. Each reason ``by_load`` gives
is logged once; every failed lookup is logged, through ``Throttled``: at most one warning per
``WARN_EVERY_S``, each one counting the failures held back since the last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

WARN_EVERY_S = 10.0
"""The least time between two warnings of one ``Throttled``."""
UNREACHABLE = "controller unreachable"
"""The ``reason`` of ``/health`` while the controller does not answer (under ``kv``)."""


class Throttled:
    """``log.warning`` at most once per ``every_s`` (``clock`` in seconds); a warning held back
    is counted, and the next one sent says how many were."""

    def __init__(self, log: logging.Logger, every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.every_s = every_s
        self.clock = clock
        self.suppressed = 0
        self._last: float | None = None

    def warning(self, message: str) -> bool:
        """Log ``message`` unless one went out less than ``every_s`` ago; whether it was logged."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self.suppressed += 1
            return False
        if self.suppressed and self._last is not None:
            message += f" ({self.suppressed} more like it in the last {now - self._last:.0f} s not logged)"
        self.log.warning("%s", message)
        self._last, self.suppressed = now, 0
        return True


class RoutingStatus:
    """How the last request was routed under ``policy`` (one of ``POLICIES``); the falls back
    to load are logged on ``log`` (a failed lookup through ``warn``, every reason else once)."""

    def __init__(self, policy: str, log: logging.Logger, warn: Throttled) -> None:
        self.policy = policy
        self.log = log
        self.warn = warn
        self.mode = policy
        self.reason: str | None = None if policy == "kv" else f"--policy {policy}"
        self._told: set[str] = set()

    def by_prefix(self) -> None:
        """The controller's lookup answered: the request was ranked by its cached prefix."""
        self.mode, self.reason = "kv", None

    def by_load(self, reason: str) -> None:
        """No lookup could be asked, for ``reason`` (logged the first time it is given)."""
        self.mode, self.reason = "load", reason
        if reason not in self._told:
            self._told.add(reason)
            self.log.warning("kvlayer router: routing by load: %s (logged once)", reason)

    def lookup_failed(self, model: str, failure: str) -> None:
        """The controller's lookup for ``model`` failed (``failure``: the call, its gRPC status
        and message); the request was routed by load (logged, rate limited)."""
        self.mode, self.reason = "load", f"the controller's lookup failed: {failure}"
        self.warn.warning(f"kvlayer router: a request for {model!r} is routed by load: {self.reason}")

    def as_json(self, controller_answering: bool) -> dict[str, Any]:
        """``{"policy", "mode", "reason"}``; under ``kv`` a controller that does not answer
        means mode "load", reason ``UNREACHABLE``; ``reason`` is None when routed by prefix."""
        if self.policy == "kv" and not controller_answering:
            return {"policy": self.policy, "mode": "load", "reason": UNREACHABLE}
        return {"policy": self.policy, "mode": self.mode, "reason": self.reason}
