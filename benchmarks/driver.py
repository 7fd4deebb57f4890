"""Drives an ``LLMEngine`` through ``add_request``/``step`` with timed arrivals, one clock per run.

Clocks:

- ``SimClock`` (the default): simulated time that advances by the measured wall time of each
  engine step; when the engine is idle it jumps to the next arrival instead of sleeping. Every
  second of compute is real, idle time costs nothing, and background I/O gets no idle time
  to hide in (which can only make kvlayer look worse).
- ``RealClock``: wall time; the driver sleeps until the next arrival when idle.

Each user has at most one request in flight: a turn whose time has come waits for its user's
previous answer, and its TTFT counts from when it is submitted (``submit_time``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvlayer.benchmarks.workloads import Turn


class Clock(Protocol):
    def now(self) -> float: ...

    def advance(self, seconds: float) -> None:
        """A step took ``seconds`` of wall time."""

    def wait_until(self, t: float) -> None:
        """Nothing to do before ``t``."""


class SimClock:
    """Simulated seconds: steps advance it by their measured duration; idle waits jump."""

    name = "sim"

    def __init__(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        self._t += seconds

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)


class RealClock:
    """Wall-clock seconds since construction; idle waits sleep."""

    name = "real"

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, seconds: float) -> None:
        pass

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


CLOCKS: dict[str, Callable[[], Clock]] = {"sim": SimClock, "real": RealClock}


class Sessions(Protocol):
    """What the driver asks of a workload: each turn's prompt, and the answer it got."""

    def prompt(self, turn: Turn) -> list[int]: ...

    def answered(self, turn: Turn, prompt: list[int], output: list[int]) -> None: ...


@dataclass(slots=True)
class RequestRecord:
    """One served turn: times on the run's clock, prompt size and where its prefix came from
    (``num_cached``: the engine's prefix cache; ``num_external``: kvlayer), at first token.
    ``unqueued_ttft``: wall seconds from the engine first scheduling it to its first token
    (TTFT without the wait in the queue)."""

    turn: Turn
    submit_time: float
    num_prompt: int
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output: int = 0
    num_cached: int = 0
    num_external: int = 0
    unqueued_ttft: float | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token_time is not None
        return self.first_token_time - self.submit_time


def drive(engine: Any, turns: list[Turn], sessions: Sessions, params: Any, clock: Clock,
          advance: Callable[[int], None] = lambda n: None) -> list[RequestRecord]:
    """Serve every turn through ``engine`` (an ``LLMEngine``) with sampling ``params``; returns
    the records in finishing order. ``advance(1)`` is called as each request finishes."""
    queues: dict[int, deque[Turn]] = {}
    for turn in sorted(turns, key=lambda t: (t.time, t.user, t.index)):
        queues.setdefault(turn.user, deque()).append(turn)
    live: dict[str, tuple[RequestRecord, list[int]]] = {}
    busy: set[int] = set()
    done: list[RequestRecord] = []
    while any(queues.values()) or live:
        now = clock.now()
        due = sorted((q[0] for u, q in queues.items() if q and u not in busy and q[0].time <= now),
                     key=lambda t: (t.time, t.user))
        for turn in due:
            queues[turn.user].popleft()
            prompt = sessions.prompt(turn)
            rid = engine.add_request({"prompt_token_ids": prompt}, params)
            live[rid] = (RequestRecord(turn, now, len(prompt)), prompt)
            busy.add(turn.user)
        if not live:
            clock.wait_until(min(q[0].time for u, q in queues.items() if q and u not in busy))
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        clock.advance(time.perf_counter() - t0)
        now = clock.now()
        for out in outputs:
            rec, prompt = live[out.request_id]
            if rec.first_token_time is None:
                rec.first_token_time = now
                rec.num_cached, rec.num_external = out.num_cached_tokens, out.num_external_tokens
                m = out.metrics
                if m.first_scheduled_time is not None and m.first_token_time is not None:
                    rec.unqueued_ttft = m.first_token_time - m.first_scheduled_time
            if out.finished:
                rec.finish_time = now
                tokens = list(out.outputs[0].token_ids)
                rec.num_output = len(tokens)
                sessions.answered(rec.turn, prompt, tokens)
                busy.discard(rec.turn.user)
                del live[out.request_id]
                done.append(rec)
                advance(1)
    return done
