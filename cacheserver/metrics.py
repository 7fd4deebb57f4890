"""The cache server's accounting for Prometheus: ``kvlayer cache-server --metrics-port PORT``.

``ServerCollector`` turns a server's counts into ``kvlayer_cache_server_*`` series (the names are
listed in docs/cache-server.md); ``MetricsEndpoint`` answers ``GET /metrics`` on the server's own
asyncio loop, so a scrape reads the index between two requests and never races them (no thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.index import ChunkIndex

PREFIX = "kvlayer_cache_server_"
MAX_REQUEST = 8192
"""The most bytes of request line and headers a scrape may send."""


class Scrubbed(Protocol):
    """What the collector reads of a server's scrub (``Scrubber``)."""

    hashed_bytes: int


class Counted(Protocol):
    """What the collector reads of a server's lower tiers (``LowerTiers``)."""

    def stats(self) -> dict[str, int]: ...


class Accounted(Protocol):
    """What the collector reads of a server (``CacheServer``)."""

    index: ChunkIndex
    accepted: int
    refusals: dict[str, int]
    scrub: Scrubbed
    lower: Counted | None

    def stats(self) -> wire.Stats: ...


class ServerCollector(Collector):
    """The series of one server, read at scrape time."""

    def __init__(self, server: Accounted) -> None:
        self._server = server

    def describe(self) -> Iterator[Metric]:
        """No families ahead of time (the registry is the server's own: nothing to clash with)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        """Every family with its current samples."""
        s, index = self._server.stats(), self._server.index
        for name, value, doc in (("capacity_bytes", s.capacity_bytes, "bytes of the arena's data region"),
                                 ("used_bytes", s.used_bytes, "bytes of allocated ranges"),
                                 ("chunks", s.chunks, "committed chunks"),
                                 ("reserved", s.reserved, "reservations not yet committed"),
                                 ("leases", s.leases, "leases held by clients (a commit is its writer's lease)"),
                                 ("connections", s.connections, "open client connections"),
                                 ("sealed_chunks", s.sealed, "committed chunks the server verified itself"),
                                 ("salt_quota_bytes", index.quota or 0, "the most one tenant holds (0: no quota)")):
            yield GaugeMetricFamily(PREFIX + name, f"cache server: {doc}", value=value)
        for name, value, doc in (("evictions", s.evictions, "chunks evicted for room"),
                                 ("refused_stores", s.refused, "reservations refused FULL (capacity or quota)"),
                                 ("accepted_connections", self._server.accepted, "connections accepted"),
                                 ("checksum_errors", s.checksum_errors,
                                  "chunks whose arena bytes failed their checksum (dropped)"),
                                 ("scrubbed_bytes", self._server.scrub.hashed_bytes,
                                  "bytes the server hashed to verify chunks (seals and re-scrubs)")):
            yield CounterMetricFamily(PREFIX + name, f"cache server: {doc}", value=value)
        for op in ("lookup", "lease"):
            fam = CounterMetricFamily(PREFIX + f"{op}_chunks", f"cache server: chunks asked for by {op.upper()}",
                                      labels=["result"])
            for result in ("hit", "miss"):
                fam.add_metric([result], index.answers[f"{op}_{result}"])
            yield fam
        fam = CounterMetricFamily(PREFIX + "refused_connections", "cache server: connections closed with an ERROR",
                                  labels=["reason"])
        for reason, n in sorted(self._server.refusals.items()):
            fam.add_metric([reason], n)
        yield fam
        if self._server.lower is not None:
            fam = CounterMetricFamily(PREFIX + "lower_events", "cache server: its NVMe and Redis tiers' counts "
                                      "(writes, write errors, promotions, misses, their backends' counters)",
                                      labels=["counter"])
            for name, n in sorted(self._server.lower.stats().items()):
                fam.add_metric([name], n)
            yield fam
        yield from _tenant_families(index.tenants())


def _tenant_families(tenants: list[wire.TenantUsage]) -> Iterator[Metric]:
    used = GaugeMetricFamily(PREFIX + "tenant_used_bytes", "cache server: bytes one tenant holds", labels=["tenant"])
    chunks = GaugeMetricFamily(PREFIX + "tenant_chunks", "cache server: committed chunks of one tenant",
                               labels=["tenant"])
    refused = CounterMetricFamily(PREFIX + "tenant_refused_stores", "cache server: one tenant's refused reservations",
                                  labels=["tenant"])
    for t in tenants:
        label = [t.tenant.hex()]
        used.add_metric(label, t.used_bytes)
        chunks.add_metric(label, t.chunks)
        refused.add_metric(label, t.refused)
    yield from (used, chunks, refused)


class MetricsEndpoint:
    """``http://host:port/metrics`` of ``server``, served on the running loop; ``start`` binds it."""

    def __init__(self, server: Accounted, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._registry = CollectorRegistry()
        self._registry.register(ServerCollector(server))
        self._http: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        """Bind; ``ValueError`` (one line) when the port cannot be had: the server does not start without it."""
        try:
            self._http = await asyncio.start_server(self._answer, self.host, self.port, limit=MAX_REQUEST)
        except OSError as e:
            raise ValueError(f"--metrics-port {self.port}: cannot listen on {self.host}: "
                             f"{os.strerror(e.errno) if e.errno else e}") from None

    def close(self) -> None:
        """Stop listening."""
        if self._http is not None:
            self._http.close()
            self._http = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) != 3 or parts[0] != b"GET":
                writer.write(_response(405, b"only GET\n", "text/plain"))
            elif parts[1].split(b"?", 1)[0] != b"/metrics":
                writer.write(_response(404, b"see /metrics\n", "text/plain"))
            else:
                writer.write(_response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away or sent no request: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _response(status: int, body: bytes, content_type: str) -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body
