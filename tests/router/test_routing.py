"""``kvlayer router`` over two ``kvlayer serve`` instances and a controller: it follows the cache."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from tests.controller.harness import wait_until
from tests.router.conftest import complete, fleet, holds, random_ids, wait_seen_idle


@pytest.fixture(scope="module")
def two(model, tmp_path_factory):
    with fleet(model, tmp_path_factory.mktemp("fleet")) as f:
        yield f


@pytest.mark.parametrize(("holder", "seed"), [("a", 1), ("b", 2)])
def test_a_request_goes_to_the_instance_that_holds_its_prefix(two, holder, seed):
    prefix = random_ids(160, seed=seed)
    direct = complete(two[holder].url, prefix)  # only `holder` computes (and stores) it
    assert direct.status_code == 200
    wait_until(lambda: holds(two["admin"], prefix, holder) == 160, what=f"{holder} registered the prefix")
    wait_seen_idle(two["router"].url, holder)
    for k in range(3):
        answer = complete(two["router"].url, prefix + [7, k])
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvlayer-instance"] == holder
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160


def test_the_routed_answer_equals_the_instances_own(two):
    prompt = random_ids(50, seed=3)
    routed = complete(two["router"].url, prompt, max_tokens=8).json()["choices"][0]["token_ids"]
    for name in ("a", "b"):
        assert complete(two[name].url, prompt, max_tokens=8).json()["choices"][0]["token_ids"] == routed


def test_unrelated_requests_spread_by_load(two):
    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        return await c.post(f"{two['router'].url}/v1/completions", json={
            "model": "tiny", "prompt": random_ids(20, seed=1000 + i), "max_tokens": 40, "temperature": 0,
            "ignore_eos": True})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    answers = asyncio.run(burst())
    assert all(r.status_code == 200 for r in answers)
    spread = Counter(r.headers["x-kvlayer-instance"] for r in answers)
    assert set(spread) == {"a", "b"} and min(spread.values()) >= 2, spread


def test_streams_go_through_and_carry_the_instance_header(two):
    with httpx.stream("POST", f"{two['router'].url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": random_ids(30, seed=4), "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200 and r.headers["x-kvlayer-instance"] in ("a", "b")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 7


def test_router_errors_are_openai_json(two):
    r = httpx.post(f"{two['router'].url}/v1/completions", json={"model": "other", "prompt": [1], "max_tokens": 1})
    assert r.status_code == 404 and "the model 'other' does not exist" in r.json()["error"]["message"]
    bad = httpx.post(f"{two['router'].url}/v1/completions", content=b"[1]")
    assert bad.status_code == 400 and "must be a JSON object" in bad.json()["error"]["message"]
    passed_on = complete(two["router"].url, random_ids(5, seed=5), max_tokens=-1)  # the instance's own 400
    assert passed_on.status_code == 400 and "max_tokens must be >= 1" in passed_on.json()["error"]["message"]
    models = httpx.get(f"{two['router'].url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
