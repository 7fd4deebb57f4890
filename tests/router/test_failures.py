"""The router when parts of the fleet fail: an instance SIGKILLed, the controller gone and back, keys."""

from __future__ import annotations

import json
import threading

import httpx

from tests.controller.fleet import ControllerProcess
from tests.controller.harness import wait_until
from tests.router.conftest import complete, fleet, holds, random_ids, router_metric, wait_seen_idle


def up(router_url: str) -> list[str]:
    r = httpx.get(f"{router_url}/health", timeout=10)
    return r.json().get("instances", []) if r.status_code == 200 else []


def controller_state(router_url: str) -> str:
    return httpx.get(f"{router_url}/health", timeout=10).json()["controller"]


def test_an_instance_killed_fails_no_request_that_had_not_started_streaming(model, tmp_path):
    with fleet(model, tmp_path, router_args=("--load-cost", "10")) as f:  # the prefix outweighs b's stream
        router, prefix = f["router"].url, random_ids(96, seed=11)
        assert complete(f["b"].url, prefix).status_code == 200  # b holds the prefix: the router sends it there
        wait_until(lambda: holds(f["admin"], prefix, "b") == 96, what="b registered the prefix")
        stream = httpx.stream("POST", f"{router}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prefix + [1], "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True})
        answers: list[httpx.Response] = []
        with stream as s:
            assert s.headers["x-kvlayer-instance"] == "b"
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")  # streaming from b
            pending = threading.Thread(target=lambda: answers.append(complete(router, prefix + [2], max_tokens=600)))
            pending.start()  # also routed to b, not answered yet when b dies
            wait_until(lambda: router_metric(router, 'kvlayer_router_instance_load{instance="b"}') >= 2,
                       what="the second request running on b")
            f["b"].kill()
            rest = [line for line in lines if line]
        pending.join(60)
        assert rest[-1] == "data: [DONE]"
        assert "failed mid-stream" in json.loads(rest[-2].removeprefix("data: "))["error"]["message"]
        retried = answers[0]
        assert retried.status_code == 200, retried.text
        assert retried.headers["x-kvlayer-instance"] == "a" and retried.json()["usage"]["completion_tokens"] == 600
        assert router_metric(router, "kvlayer_router_retries_total") >= 1
        assert up(router) == ["a"], "the dead instance leaves the routing set at once"
        for k in range(4):
            assert complete(router, random_ids(20, seed=50 + k)).headers["x-kvlayer-instance"] == "a"

        f["b"].start()  # the same port again: it rejoins when healthy
        wait_until(lambda: up(router) == ["a", "b"], what="b back in the routing set", timeout=60)


def test_keys_and_the_controller_killed_and_restarted(model, tmp_path):
    client_keys, instance_key = tmp_path / "clients", tmp_path / "instance"
    client_keys.write_text("sk-client\n", encoding="utf-8")
    instance_key.write_text("sk-instance\n", encoding="utf-8")
    locked = ("--api-key-file", str(instance_key))
    with fleet(model, tmp_path, instance_args={"a": locked, "b": locked},
               router_args=("--api-key-file", str(client_keys), "--instance-api-key-file", str(instance_key))) as f:
        router, controller = f["router"].url, f["controller"]
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
        refused = httpx.post(f"{router}/v1/completions", json=body)
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        assert complete(router, [5, 6, 7], key="sk-instance").status_code == 401, "the instances' key is not a client's"
        assert complete(f["a"].url, [5, 6, 7]).status_code == 401, "the instances stay locked"

        prefix = random_ids(96, seed=12)
        assert complete(f["a"].url, prefix, key="sk-instance").status_code == 200
        wait_until(lambda: holds(f["admin"], prefix, "a") == 96, what="a registered the prefix")
        wait_seen_idle(router, "a")
        assert complete(router, prefix + [1], key="sk-client").headers["x-kvlayer-instance"] == "a"
        controller.kill()
        for k in range(4):  # routed by load meanwhile: never failed for the controller's sake
            answer = complete(router, prefix + [k], key="sk-client")
            assert answer.status_code == 200, answer.text
        assert router_metric(router, "kvlayer_router_lookup_failures_total") >= 4
        assert controller_state(router) == "unreachable" and up(router) == ["a", "b"], "still healthy, by load"
        again = ControllerProcess(tmp_path, ["--heartbeat-interval", "0.2"], port=controller.port)
        try:
            wait_until(lambda: holds(f["admin"], prefix, "a") == 96 and holds(f["admin"], prefix, "b") == 96,
                       what="the registry rebuilt from both snapshots", timeout=60)  # b stored it meanwhile
            # the router's channel waits at most 2 s between attempts, and its fleet poll then succeeds
            wait_until(lambda: controller_state(router) == "ok", what="the router reached the controller", timeout=10)
            fresh = random_ids(96, seed=13)
            assert complete(f["b"].url, fresh, key="sk-instance").status_code == 200
            wait_until(lambda: holds(f["admin"], fresh, "b") == 96, what="b registered a new prefix")
            wait_seen_idle(router, "b")
            assert all(complete(router, fresh + [k], key="sk-client").headers["x-kvlayer-instance"] == "b"
                       for k in range(3)), "routing by prefix resumed"
        finally:
            again.kill()
