"""Per-tier counters and latency histograms (docs/architecture.md section 9).

``Metrics`` holds one ``TierMetrics`` per tier: plain, thread-safe counters (``COUNTERS``)
and histograms (``HISTOGRAMS``, seconds). ``snapshot()`` returns them as plain data; the
same object is a prometheus-client collector exposing ``kvlayer_<counter>_total``,
``kvlayer_<histogram>`` and the gauges of an optional source, labelled ``tier`` and
``instance``. It is registered nowhere by default (several engines in one process never
collide); ``register(registry)`` adds it to a ``CollectorRegistry`` of the caller's.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

COUNTERS: tuple[str, ...] = (
    "lookups", "lookup_chunks", "lookup_hit_chunks", "hit_tokens", "get_chunks", "get_bytes", "put_chunks", "put_bytes",
    "evictions", "errors", "timeouts", "checksum_errors", "promotions", "promotions_declined", "skipped_unhealthy",
    "verified_hits", "verify_mismatches",
)
HISTOGRAMS: tuple[str, ...] = ("get_seconds", "put_seconds")
BUCKETS: tuple[float, ...] = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                              1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the histogram buckets; an implicit +Inf bucket follows."""

GaugeSource = Callable[[], dict[str, dict[str, float]]]
"""Returns ``{tier: {gauge_name: value}}`` at scrape time (e.g. used_bytes, healthy)."""


class TierMetrics:
    """One tier's counters and histograms; every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._hist = {name: [0] * (len(BUCKETS) + 1) for name in HISTOGRAMS}
        self._sums = dict.fromkeys(HISTOGRAMS, 0.0)

    def inc(self, counter: str, n: int = 1) -> None:
        """Add ``n`` (>= 0) to ``counter``; KeyError for a name not in ``COUNTERS``."""
        if n < 0:
            raise ValueError(f"counter {counter} cannot go down (n={n})")
        with self._lock:
            self._counts[_known(self._counts, counter)] += n

    def observe(self, histogram: str, seconds: float) -> None:
        """Record one latency in ``histogram`` (a name in ``HISTOGRAMS``)."""
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            self._hist[_known(self._hist, histogram)][i] += 1
            self._sums[histogram] += seconds

    def get(self, counter: str) -> int:
        with self._lock:
            return self._counts[_known(self._counts, counter)]

    def snapshot(self) -> dict[str, object]:
        """``{counter: int, ..., histogram: {"buckets": [[le, cumulative]], "sum", "count"}}``."""
        with self._lock:
            out: dict[str, object] = dict(self._counts)
            for name, counts in self._hist.items():
                cumulative, total = [], 0
                for le, c in zip((*BUCKETS, float("inf")), counts):
                    total += c
                    cumulative.append([le, total])
                out[name] = {"buckets": cumulative, "sum": self._sums[name], "count": total}
            return out


class Metrics(Collector):
    """All tiers' metrics for one kvlayer instance; also a prometheus-client collector."""

    def __init__(self, instance: str = "") -> None:
        self.instance = instance
        self._lock = threading.Lock()
        self._tiers: dict[str, TierMetrics] = {}
        self._gauges: GaugeSource | None = None
        self._loaded: dict[str, int] = {}

    def tier(self, name: str) -> TierMetrics:
        """The metrics of tier ``name``, created on first use."""
        with self._lock:
            if name not in self._tiers:
                self._tiers[name] = TierMetrics()
            return self._tiers[name]

    def count(self, tier: str, counter: str, n: int = 1) -> None:
        """Shorthand for ``tier(tier).inc(counter, n)``."""
        self.tier(tier).inc(counter, n)

    def tiers(self) -> list[str]:
        with self._lock:
            return list(self._tiers)

    def add_loaded(self, group: str, tokens: int) -> None:
        """Count ``tokens`` whose KV was loaded into the engine's cache for layer group ``group``
        (``WindowGroup.name``: "full" or "window:<W>")."""
        with self._lock:
            self._loaded[group] = self._loaded.get(group, 0) + tokens

    def loaded_tokens(self) -> dict[str, int]:
        """Tokens loaded so far per layer group (``kv_stats()["loaded_tokens"]``)."""
        with self._lock:
            return dict(self._loaded)

    def set_gauge_source(self, source: GaugeSource | None) -> None:
        """Gauges read at scrape time and in ``snapshot()`` (the tier manager sets usage and health)."""
        self._gauges = source

    def snapshot(self) -> dict[str, dict[str, object]]:
        """``{tier: {counter: int, histogram: {...}, "gauges": {name: float}}}`` as plain data."""
        gauges = self._gauges() if self._gauges else {}
        out = {name: self.tier(name).snapshot() for name in self.tiers()}
        for name, values in gauges.items():
            out.setdefault(name, self.tier(name).snapshot())["gauges"] = dict(values)
        return out

    def register(self, registry: CollectorRegistry) -> None:
        """Expose these metrics through ``registry``; raises if its names are already taken there."""
        registry.register(self)

    def unregister(self, registry: CollectorRegistry) -> None:
        registry.unregister(self)

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples (lets a registry detect name clashes)."""
        yield from self._families({}, {})
        yield self._loaded_family({})

    def collect(self) -> Iterator[Metric]:
        gauges = self._gauges() if self._gauges else {}
        yield from self._families({name: self.tier(name).snapshot() for name in self.tiers()}, gauges)
        yield self._loaded_family(self.loaded_tokens())

    def _loaded_family(self, loaded: dict[str, int]) -> Metric:
        fam = CounterMetricFamily("kvlayer_loaded_tokens", "kvlayer tokens loaded per layer group",
                                  labels=["group", "instance"])
        for group, tokens in sorted(loaded.items()):
            fam.add_metric([group, self.instance], tokens)
        return fam

    def _families(self, snaps: dict[str, dict[str, object]],
                  gauges: dict[str, dict[str, float]]) -> Iterator[Metric]:
        labels = ["tier", "instance"]
        for name in COUNTERS:
            fam = CounterMetricFamily(f"kvlayer_{name}", f"kvlayer {name.replace('_', ' ')}", labels=labels)
            for tier, snap in snaps.items():
                fam.add_metric([tier, self.instance], snap[name])
            yield fam
        for name in HISTOGRAMS:
            fam = HistogramMetricFamily(f"kvlayer_{name}", f"kvlayer {name.replace('_', ' ')}", labels=labels)
            for tier, snap in snaps.items():
                h = snap[name]
                fam.add_metric([tier, self.instance], [(_le(le), c) for le, c in h["buckets"]], h["sum"])
            yield fam
        for gauge in sorted({g for values in gauges.values() for g in values}):
            fam = GaugeMetricFamily(f"kvlayer_{gauge}", f"kvlayer {gauge.replace('_', ' ')}", labels=labels)
            for tier, values in gauges.items():
                if gauge in values:
                    fam.add_metric([tier, self.instance], float(values[gauge]))
            yield fam


def _known(table: dict[str, object], name: str) -> str:
    if name not in table:
        raise KeyError(f"unknown kvlayer metric {name!r}; known: {sorted(table)}")
    return name


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
