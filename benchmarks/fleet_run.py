"""One configuration of ``kvlayer bench fleet``, driven through its router, and summarized.

``drive`` serves the warm-up turns and then the measured ones (benchmarks/http_driver.py: one
asyncio task per user, on the wall clock) through the router, sampling the router's
``kvlayer_router_instance_load{instance}`` gauge every ``LOAD_SAMPLE_S`` while it measures, and
reads the router's counters at the end. ``summarize_config`` turns that into plain data:
``summarize_http``'s figures plus, per instance, the measured requests it answered (the
``x-kvlayer-instance`` header), the requests the router sent it (a P/D prefill counts there
too), its mean sampled load and the prompt tokens it computed (prompt less cached).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvlayer.benchmarks.driver import Sessions
from kvlayer.benchmarks.http_client import make_client
from kvlayer.benchmarks.http_driver import HttpRecord, run_phase, summarize_http
from kvlayer.benchmarks.workloads import Turn

LOAD_SAMPLE_S = 0.25
_SERIES = re.compile(r'^(kvlayer_router_\w+?)(?:\{instance="([^"]*)"\})? ([0-9.eE+-]+)$', re.MULTILINE)
COUNTERS = ("retries", "lookup_failures", "stream_errors", "pd_prefills", "pd_colocated")
"""The router's ``kvlayer_router_<name>_total`` counters kept in the record."""


@dataclass(frozen=True, slots=True)
class Drive:
    """What one configuration gave: the warm-up and measured records, the load samples per
    instance (measured phase only) and the router's series at the end (name -> instance ->
    value; instance "" for a series without one)."""

    warmup: list[HttpRecord]
    measured: list[HttpRecord]
    loads: dict[str, list[float]]
    router: dict[str, dict[str, float]]


def parse_series(text: str) -> dict[str, dict[str, float]]:
    """The ``kvlayer_router_*`` samples of a Prometheus text page: name -> instance -> value."""
    out: dict[str, dict[str, float]] = {}
    for name, instance, value in _SERIES.findall(text):
        out.setdefault(name, {})[instance] = float(value)
    return out


async def drive(url: str, model: str, sessions: Sessions, warmup: list[Turn], turns: list[Turn],
                answer_tokens: int, users: int, timeout_s: float, advance: Callable[[int], None]) -> Drive:
    """Serve ``warmup`` then ``turns`` through the router at ``url`` (see the module docstring)."""
    async with make_client(url, None, timeout_s, users + 1) as client:
        warm = await run_phase(client, model, warmup, sessions, answer_tokens, advance)
        loads: dict[str, list[float]] = {}
        done = asyncio.Event()
        sampler = asyncio.create_task(_sample_loads(client, loads, done))
        try:
            measured = await run_phase(client, model, turns, sessions, answer_tokens, advance)
        finally:
            done.set()
            await sampler
        router = parse_series((await client.get("/metrics")).text)
    return Drive(warm, measured, loads, router)


async def _sample_loads(client: httpx.AsyncClient, loads: dict[str, list[float]], done: asyncio.Event) -> None:
    while not done.is_set():
        try:
            page = await client.get("/metrics")
            for instance, value in parse_series(page.text).get("kvlayer_router_instance_load", {}).items():
                loads.setdefault(instance, []).append(value)
        except httpx.HTTPError:
            pass  # a missed sample; the run's own requests show any real failure
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), LOAD_SAMPLE_S)


def summarize_config(name: str, roles: dict[str, str], result: Drive) -> dict[str, Any]:
    """The record of one configuration (see the module docstring); ``roles``: instance -> role."""
    summary = summarize_http(name, result.measured)
    summary["warmup"] = summarize_http(name, result.warmup)
    routed = result.router.get("kvlayer_router_requests_total", {})
    ok = [r for r in result.measured if r.result.ok]
    per: dict[str, dict[str, Any]] = {}
    for inst in sorted(set(roles) | {r.result.instance or "?" for r in result.measured}):
        mine = [r for r in ok if r.result.instance == inst]
        samples = result.loads.get(inst, [])
        per[inst] = {
            "role": roles.get(inst), "requests": sum(r.result.instance == inst for r in result.measured),
            "routed_total": int(routed.get(inst, 0)),
            "mean_load": sum(samples) / len(samples) if samples else None,
            "computed_prompt_tokens": sum((r.result.prompt_tokens or r.num_prompt) - (r.result.cached_tokens or 0)
                                          for r in mine)}
    summary["instances"] = per
    summary["router"] = {c: int(result.router.get(f"kvlayer_router_{c}_total", {}).get("", 0)) for c in COUNTERS}
    return summary
