"""Tests of kvlayer/health.py: unhealthy after N failures, doubling backoff, probes, recovery."""

from __future__ import annotations

import pytest

from kvlayer.health import LogThrottle, TierHealth


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_becomes_unhealthy_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    h = TierHealth(3, clock=clock)
    assert not h.record_failure() and not h.record_failure()
    h.record_success()  # resets the run of failures
    assert not h.record_failure() and not h.record_failure()
    assert h.healthy and h.available()
    assert h.record_failure()  # the third in a row
    assert not h.healthy and not h.available()
    assert h.backoff_s == 1.0 and h.retry_in() == pytest.approx(1.0)


def test_backoff_doubles_on_failed_probes_up_to_30s() -> None:
    clock = FakeClock()
    h = TierHealth(1, clock=clock)
    h.record_failure()
    seen = []
    for _ in range(7):
        clock.now += h.backoff_s - 0.01
        assert not h.available()
        clock.now += 0.01
        assert h.available()  # the probe may go
        h.record_failure()
        seen.append(h.backoff_s)
    assert seen == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_failures_during_the_backoff_do_not_extend_it() -> None:
    clock = FakeClock()
    h = TierHealth(1, clock=clock)
    h.record_failure()
    clock.now += 0.5
    h.record_failure()  # a call begun before the tier was marked unhealthy
    assert h.backoff_s == 1.0
    clock.now += 0.5
    assert h.available()


def test_a_successful_probe_recovers_and_resets() -> None:
    clock = FakeClock()
    h = TierHealth(2, clock=clock)
    h.record_failure()
    h.record_failure()
    clock.now += 1.0
    assert h.record_success()
    assert h.healthy and h.backoff_s == 0 and h.consecutive_failures == 0
    assert not h.record_success()
    assert h.snapshot() == {"healthy": True, "consecutive_failures": 0, "backoff_s": 0.0, "retry_in_s": 0.0}
    h.record_failure()
    h.record_failure()
    assert h.backoff_s == 1.0  # the backoff starts again from 1 s


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="unhealthy_after"):
        TierHealth(0)
    with pytest.raises(ValueError, match="backoff"):
        TierHealth(1, base_backoff_s=5, max_backoff_s=1)


def test_log_throttle_allows_one_line_per_interval() -> None:
    clock = FakeClock()
    t = LogThrottle(10.0, clock=clock)
    assert t.allow()
    assert not any(t.allow() for _ in range(5))
    clock.now += 10.0
    assert t.allow() and t.last_suppressed == 5
    assert not t.allow()
