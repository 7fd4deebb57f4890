"""The router's ``/metrics`` (all prefixed ``kvlayer_router_``): ``requests_total{instance}``
(answers forwarded), ``retries_total`` (a second instance tried), ``stream_errors_total`` (an
instance failed mid-stream), ``lookup_seconds`` (the controller's lookups),
``lookup_failures_total`` (refused, past the deadline or the controller away: routed by load,
and logged, rate limited: routing_status.py),
``pd_prefills_total`` and ``pd_colocated_total`` (P/D requests served without a prefill or
decode instance up), and the gauges ``instances_up`` and ``instance_load{instance}``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LOOKUP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


class RouterMetrics:
    """The series in their own registry; ``render(fleet)`` sets the gauges from ``fleet`` first."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvlayer_router_requests", "Requests forwarded, by instance", ["instance"], registry=r)
        self.retries = Counter("kvlayer_router_retries", "Requests sent again to the next instance", registry=r)
        self.stream_errors = Counter("kvlayer_router_stream_errors", "Streams an instance broke", registry=r)
        self.lookup_seconds = Histogram("kvlayer_router_lookup_seconds", "The controller's prefix lookups",
                                        buckets=LOOKUP_BUCKETS, registry=r)
        self.lookup_failures = Counter("kvlayer_router_lookup_failures", "Lookups refused or not answered in time",
                                       registry=r)
        self.pd_prefills = Counter("kvlayer_router_pd_prefills", "Prompts sent to a prefill instance", registry=r)
        self.pd_colocated = Counter("kvlayer_router_pd_colocated", "P/D requests served colocated", registry=r)
        self.instances_up = Gauge("kvlayer_router_instances_up", "Instances in the routing set", registry=r)
        self.instance_load = Gauge("kvlayer_router_instance_load", "Running + waiting requests", ["instance"],
                                   registry=r)

    def render(self, fleet: Any) -> bytes:
        self.instances_up.set(sum(1 for i in fleet.instances.values() if i.up))
        for inst in fleet.instances.values():
            self.instance_load.labels(inst.instance_id).set(inst.load)
        return generate_latest(self.registry)
