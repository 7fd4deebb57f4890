"""Serving kvlayer's metrics over HTTP for Prometheus (``metrics_port`` in the config).

One HTTP server per address and process, started by the first ``KVCacheEngine`` asking for
it. Each server exposes the engines registered on it through one collector that merges their
series, which differ by the ``instance`` label.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvlayer.metrics import Metrics

log = logging.getLogger(__name__)


class _Group(Collector):
    """The series of several ``Metrics``, families merged by name."""

    def __init__(self) -> None:
        self.members: list[Metrics] = []

    def describe(self) -> list[Metric]:
        return []  # the members change at run time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for member in list(self.members):
            for family in member.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        return iter(merged.values())


_lock = threading.Lock()
_groups: dict[tuple[str, int], _Group] = {}


def expose(metrics: Metrics, host: str, port: int) -> bool:
    """Serve ``metrics`` at ``http://host:port/metrics`` (starting the server on first use).

    Returns False, with one log line, when the port cannot be bound; the engine runs on
    without the endpoint.
    """
    with _lock:
        group = _groups.get((host, port))
        if group is None:
            group, registry = _Group(), CollectorRegistry()
            registry.register(group)
            try:
                start_http_server(port, addr=host, registry=registry)
            except OSError as e:
                log.warning("kvlayer: cannot serve metrics on %s:%d: %s", host, port, e)
                return False
            _groups[(host, port)] = group
            log.info("kvlayer: metrics at http://%s:%d/metrics", host, port)
        group.members.append(metrics)
    return True


def withdraw(metrics: Metrics, host: str, port: int) -> None:
    """Stop exposing ``metrics`` (its engine closed); the server runs on for the others."""
    with _lock:
        group = _groups.get((host, port))
        if group is not None and metrics in group.members:
            group.members.remove(metrics)
