"""The router says how it routes and why: failed lookups are logged, rate limited, and ``/health``
shows the routing mode and its reason (router/routing_status.py).

Run: ``.venv/bin/python -m pytest tests/router/test_routing_status.py``. The rate limiter and the
status alone, on a fake clock; then a real fleet (a controller, one ``kvlayer serve`` on the tiny
model, a router): the controller refuses text lookups (it has no tokenizer), then is killed.
"""

from __future__ import annotations

import contextlib
import logging
import time

import httpx
import pytest

from kvlayer.router.routing_status import UNREACHABLE, WARN_EVERY_S, RoutingStatus, Throttled
from tests.controller.fleet import ControllerProcess
from tests.controller.harness import wait_until
from tests.router.conftest import complete, fleet, random_ids, router_metric

ROUTED_BY_LOAD = "is routed by load"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throttled_logs_one_warning_per_interval_and_counts_the_rest(caplog):
    clock, log = Clock(), logging.getLogger("test.throttled")
    warn = Throttled(log, every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert warn.warning("first")
        clock.now += 3
        assert not warn.warning("second") and not warn.warning("third")
        clock.now += 6.9
        assert not warn.warning("fourth")
        clock.now += 0.2
        assert warn.warning("fifth")
        clock.now += 10
        assert warn.warning("sixth")
    assert [r.getMessage() for r in caplog.records] == [
        "first", "fifth (3 more like it in the last 10 s not logged)", "sixth"]


def test_routing_status_modes_and_reasons(caplog):
    log = logging.getLogger("test.routing")
    kv = RoutingStatus("kv", log, Throttled(log, clock=Clock()))
    assert kv.as_json(True) == {"policy": "kv", "mode": "kv", "reason": None}
    assert kv.as_json(False) == {"policy": "kv", "mode": "load", "reason": UNREACHABLE}
    with caplog.at_level(logging.WARNING, logger=log.name):
        kv.by_load("no tokenizer")
        kv.by_load("no tokenizer")
        assert kv.as_json(True) == {"policy": "kv", "mode": "load", "reason": "no tokenizer"}
        kv.lookup_failed("tiny", "Lookup NOT_FOUND: no live instance")
        assert kv.as_json(True)["reason"] == "the controller's lookup failed: Lookup NOT_FOUND: no live instance"
        kv.by_prefix()
        assert kv.as_json(True) == {"policy": "kv", "mode": "kv", "reason": None}
    assert [r.getMessage() for r in caplog.records] == [
        "kvlayer router: routing by load: no tokenizer (logged once)",
        "kvlayer router: a request for 'tiny' is routed by load: the controller's lookup failed: Lookup NOT_FOUND: "
        "no live instance"]
    other = RoutingStatus("round-robin", log, Throttled(log))
    assert other.as_json(False) == {"policy": "round-robin", "mode": "round-robin", "reason": "--policy round-robin"}


@pytest.fixture(scope="module")
def one(model, tmp_path_factory):
    """A fleet of one instance "a"; ``stack`` stops what a test starts in it."""
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(fleet(model, tmp_path_factory.mktemp("routing-status"), names=("a",)))
        yield {**f, "stack": stack}


def routing(router_url: str) -> dict:
    return httpx.get(f"{router_url}/health", timeout=10).json()["routing"]


def text(router_url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{router_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})


def warnings(proc) -> list[str]:
    return [line for line in proc.log().splitlines() if ROUTED_BY_LOAD in line]


def test_refused_lookups_are_logged_rate_limited_and_health_says_why(one):
    router = one["router"]
    assert complete(router.url, random_ids(20, seed=1)).status_code == 200
    assert routing(router.url) == {"policy": "kv", "mode": "kv", "reason": None}
    assert warnings(router) == []

    first = time.monotonic()
    for k in range(5):  # the controller has no tokenizer: it refuses text lookups; served by load
        answer = text(router.url, f"hello number {k}")
        assert answer.status_code == 200, answer.text
    assert router_metric(router.url, "kvlayer_router_lookup_failures_total") == 5
    status = routing(router.url)
    assert status["policy"] == "kv" and status["mode"] == "load"
    assert "lookup failed: Lookup INVALID_ARGUMENT: text needs a tokenizer" in status["reason"]
    wait_until(lambda: len(warnings(router)) == 1, what="the first refusal logged")
    assert "'tiny'" in warnings(router)[0] and "INVALID_ARGUMENT" in warnings(router)[0]
    time.sleep(0.5)
    assert len(warnings(router)) == 1, "four more within WARN_EVERY_S are held back"

    time.sleep(max(0.0, first + WARN_EVERY_S + 0.2 - time.monotonic()))
    assert text(router.url, "hello again").status_code == 200
    wait_until(lambda: len(warnings(router)) == 2, what="the next refusal logged")
    assert f"(4 more like it in the last {WARN_EVERY_S:.0f} s not logged)" in warnings(router)[1]
    assert complete(router.url, random_ids(20, seed=2)).status_code == 200
    assert routing(router.url) == {"policy": "kv", "mode": "kv", "reason": None}, "by prefix again"


def test_deep_nesting_through_the_router_is_400(one):
    answer = httpx.post(f"{one['router'].url}/v1/completions", content=b"[" * 100_000, timeout=30,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "nests deeper than" in answer.json()["error"]["message"]


def test_a_controller_that_is_down_means_routing_by_load(one, tmp_path):
    router, controller = one["router"], one["controller"]
    controller.kill()
    wait_until(lambda: routing(router.url) == {"policy": "kv", "mode": "load", "reason": UNREACHABLE},
               what="the router saw the controller gone")
    answer = complete(router.url, random_ids(20, seed=3))
    assert answer.status_code == 200, answer.text
    assert httpx.get(f"{router.url}/health", timeout=10).json()["controller"] == "unreachable"
    wait_until(lambda: "did not answer" in router.log(), what="the outage logged")
    # back, so that the module's fleet is whole for any test after this one
    one["controller"] = again = ControllerProcess(tmp_path, ["--heartbeat-interval", "0.2"], port=controller.port)
    one["stack"].callback(again.kill)
    healed = {"controller": "ok", "instances": ["a"]}
    wait_until(lambda: {k: httpx.get(f"{router.url}/health", timeout=10).json().get(k) for k in healed} == healed,
               what="the router reached the controller again, a registered", timeout=60)
