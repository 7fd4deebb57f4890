"""The agent's event buffer: ordered, bounded, only while recording."""

from __future__ import annotations

from kvlayer.controller.events import EventBuffer


def d(i: int) -> bytes:
    return bytes([i]) * 32


def test_events_keep_their_order_and_batch_size():
    buf = EventBuffer(limit=100)
    buf.add("cpu", True, [d(0)])  # not recording yet: dropped
    buf.record(True)
    buf.add("cpu", True, [d(1), d(2)])
    buf.add("cpu", True, [d(3)])  # merged with the previous admission
    buf.add("cpu", False, [d(1)])
    buf.add("nvme", True, [d(4)])
    events = buf.drain(batch=2)
    assert [(e.tier, list(e.admitted), list(e.evicted)) for e in events] == [
        ("cpu", [d(1), d(2)], []), ("cpu", [d(3)], []), ("cpu", [], [d(1)]), ("nvme", [d(4)], [])]
    assert buf.drain(batch=2) == []


def test_overflow_drops_everything_and_asks_for_a_resync():
    buf = EventBuffer(limit=3)
    buf.record(True)
    buf.add("cpu", True, [d(1), d(2)])
    assert not buf.overflowed
    buf.add("cpu", True, [d(3), d(4)])
    assert buf.overflowed and buf.drain(10) == []
    buf.add("cpu", True, [d(5)])
    assert buf.drain(10) == [], "after an overflow nothing is kept until recording restarts"
    buf.record(True)
    assert not buf.overflowed
