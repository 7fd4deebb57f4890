"""Tests of kvlayer/metrics.py: counters, histograms, snapshots and the prometheus collector."""

from __future__ import annotations

import threading

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvlayer.metrics import BUCKETS, COUNTERS, Metrics


def test_counters_and_histograms_snapshot_as_plain_data() -> None:
    m = Metrics("engine-0")
    gpu = m.tier("gpu")
    gpu.inc("lookups")
    gpu.inc("get_bytes", 4096)
    gpu.observe("get_seconds", 0.0003)
    gpu.observe("get_seconds", 100.0)
    m.count("gpu", "get_bytes", 1000)
    snap = m.snapshot()
    assert set(snap) == {"gpu"}
    assert snap["gpu"]["lookups"] == 1 and snap["gpu"]["get_bytes"] == 5096
    assert set(COUNTERS) <= set(snap["gpu"])
    hist = snap["gpu"]["get_seconds"]
    assert hist["count"] == 2 and hist["sum"] == pytest.approx(100.0003)
    assert len(hist["buckets"]) == len(BUCKETS) + 1
    assert dict(map(tuple, hist["buckets"]))[5e-4] == 1 and hist["buckets"][-1] == [float("inf"), 2]


def test_misuse_raises() -> None:
    t = Metrics().tier("cpu")
    with pytest.raises(KeyError, match="lookupz"):
        t.inc("lookupz")
    with pytest.raises(KeyError):
        t.observe("lookups", 1.0)
    with pytest.raises(ValueError):
        t.inc("lookups", -1)


def test_counters_are_thread_safe() -> None:
    t = Metrics().tier("cpu")

    def work() -> None:
        for _ in range(5000):
            t.inc("put_chunks")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.get("put_chunks") == 20000


def test_prometheus_exposition_per_registry() -> None:
    a, b = Metrics("a"), Metrics("b")
    a.tier("gpu").inc("lookups", 3)
    a.tier("gpu").observe("put_seconds", 0.002)
    a.set_gauge_source(lambda: {"gpu": {"used_bytes": 10.0}})
    ra, rb = CollectorRegistry(), CollectorRegistry()
    a.register(ra)
    b.register(rb)  # several engines in one process: separate registries never collide
    text = generate_latest(ra).decode()
    assert 'kvlayer_lookups_total{instance="a",tier="gpu"} 3.0' in text
    assert 'kvlayer_put_seconds_bucket{instance="a",le="0.0025",tier="gpu"} 1.0' in text
    assert 'kvlayer_used_bytes{instance="a",tier="gpu"} 10.0' in text
    assert "kvlayer_lookups_total" not in generate_latest(prometheus_client.REGISTRY).decode()
    with pytest.raises(ValueError, match="Duplicated"):
        b.register(ra)
    a.unregister(ra)
    assert "kvlayer_" not in generate_latest(ra).decode()
