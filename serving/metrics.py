"""``/metrics``: kvlayer's series and the server's own, in one Prometheus registry.

Serving series (all prefixed ``kvlayer_serve_``): ``time_to_first_token_seconds`` and
``inter_token_latency_seconds`` histograms (as clients see them, from the request's arrival),
``requests_running`` and ``requests_waiting`` gauges (read when ``/metrics`` is scraped),
``kv_blocks_in_use`` and ``kv_blocks`` (the engine's cache), ``connector_requests`` and
``borrowed_chunks`` (what kvlayer still holds for requests: 0 when none runs),
``prompt_tokens_total``, ``cached_prompt_tokens_total`` (served by the engine's prefix cache
or kvlayer), ``generation_tokens_total`` and ``requests_total{finish_reason}`` counters
(``stop``, ``length``, ``error`` for a choice the engine failed, or ``abort`` for a client
that left).
The kvlayer connector's ``kvlayer_*`` tier series are registered beside them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServingMetrics:
    """The server's series in their own registry (so several servers can share a process)."""

    def __init__(self, kv_metrics: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvlayer_serve_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvlayer_serve_inter_token_latency_seconds", "Gap between a choice's tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.running = Gauge("kvlayer_serve_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("kvlayer_serve_requests_waiting", "Requests queued for the engine", registry=r)
        self.prompt_tokens = Counter("kvlayer_serve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.cached_tokens = Counter("kvlayer_serve_cached_prompt_tokens",
                                     "Prompt tokens served from a cache (engine or kvlayer)", registry=r)
        self.generation_tokens = Counter("kvlayer_serve_generation_tokens", "Tokens generated", registry=r)
        self.blocks_in_use = Gauge("kvlayer_serve_kv_blocks_in_use", "Engine KV blocks referenced by requests",
                                   registry=r)
        self.blocks_total = Gauge("kvlayer_serve_kv_blocks", "Engine KV blocks in all", registry=r)
        self.connector_requests = Gauge("kvlayer_serve_connector_requests",
                                        "Requests the kvlayer connector still tracks", registry=r)
        self.borrowed_chunks = Gauge("kvlayer_serve_borrowed_chunks",
                                     "kvlayer memory-tier chunks referenced by a load in flight", registry=r)
        self.requests = Counter("kvlayer_serve_requests", "Finished choices by finish reason",
                                ["finish_reason"], registry=r)
        if kv_metrics is not None:
            kv_metrics.register(r)

    def render(self, engine: Any) -> bytes:
        """The series, the gauges read from ``engine`` now (at scrape time, never on the engine's
        step: every value read is a plain length or a thread-safe ``stats()``)."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.blocks_total.set(engine.num_blocks)
        self.blocks_in_use.set(engine.num_blocks - engine.block_manager.num_free_blocks)
        connector = engine.connector
        self.connector_requests.set(getattr(connector, "num_tracked_requests", 0))
        stats = connector.stats() if callable(getattr(connector, "stats", None)) else {}
        tiers = stats.get("tiers", {})
        self.borrowed_chunks.set(sum(int(t.get("backend", {}).get("borrowed", 0)) for t in tiers.values()))
        return generate_latest(self.registry)
