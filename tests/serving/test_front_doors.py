"""Front doors that never stall or crash: ``kvlayer serve`` against huge, deep and out-of-range input,
and one request failing in the engine among concurrent streams (issue 25).

Run: ``.venv/bin/python -m pytest tests/serving/test_front_doors.py``. One real server process on a
copy of the tiny model whose embedding of ``NAN_TOKEN`` is NaN (tests/nan_model.py): a prompt
holding that token makes the model itself give NaN logits; every other prompt is served as by the
tiny model. Its body limit is the default (16 MiB) and its context ``MAX_MODEL_LEN`` tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from kvlayer.serving.http import DEFAULT_MAX_BODY_BYTES, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH
from tests.nan_model import NAN_TOKEN, nan_embedding_model
from tests.serve_process import ServeProcess
from tests.serving.conftest import MAX_MODEL_LEN, metric, write_kv_config
from tests.serving.test_server_errors import assert_error

HEALTH_LIMIT_S = 0.1
BIG = 10 * 1024**2
"""The size of the maximum-size prompts' bodies (under the 16 MiB limit)."""


@pytest.fixture(scope="module")
def doors(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("front-doors")
    model = nan_embedding_model(tiny_model_dir, folder / "nan-tiny")
    config = write_kv_config(folder, cpu_capacity="32MiB", chunk_size=16)
    with ServeProcess(model, "--kv-config", config, "--kv-cache-memory", "64MiB", "--served-model-name", "tiny",
                      "--max-model-len", str(MAX_MODEL_LEN)) as proc:
        yield proc


def ids(n: int, seed: int) -> list[int]:
    """``n`` random token ids, never ``NAN_TOKEN``."""
    rng = random.Random(seed)
    return [rng.randrange(NAN_TOKEN + 1, 500) for _ in range(n)]


def post(url: str, body: dict | None = None, content: bytes | None = None,
         path: str = "/v1/completions") -> httpx.Response:
    if content is None:
        content = json.dumps({"model": "tiny", "prompt": [5, 6, 8], "max_tokens": 2, **(body or {})}).encode()
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)


# ----- size and shape, before anything is parsed --------------------------------------------------
def text_body() -> bytes:
    words = " ".join(f"word{i % 997}" for i in range(BIG // 7))
    return json.dumps({"model": "tiny", "prompt": words[:BIG - 100], "max_tokens": 2}).encode()


def ids_body() -> bytes:  # millions of numbers: the slowest JSON to decode
    return b'{"model": "tiny", "max_tokens": 2, "prompt": [' + b"9," * (BIG // 2 - 40) + b"9]}"


@pytest.mark.parametrize("make", [text_body, ids_body], ids=["text", "token-ids"])
def test_health_answers_within_100_ms_while_a_maximum_size_prompt_is_processed(doors, make):
    body = make()
    assert BIG - 200 <= len(body) <= BIG
    answers: list[tuple[httpx.Response, float]] = []

    def big_requests() -> None:
        for _ in range(3):
            start = time.perf_counter()
            answers.append((post(doors.url, content=body), time.perf_counter() - start))

    probes = []
    with httpx.Client(base_url=doors.url, timeout=10) as client:
        assert client.get("/health").status_code == 200  # the probe's connection is open before
        sender = threading.Thread(target=big_requests)
        sender.start()
        while sender.is_alive():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            probes.append(time.perf_counter() - start)
            time.sleep(0.002)
        sender.join()
    assert len(probes) >= 5, probes
    assert max(probes) < HEALTH_LIMIT_S, f"the slowest of {len(probes)} probes: {max(probes):.3f} s"
    for answer, elapsed in answers:
        assert_error(answer, 400, f"this model's context holds {MAX_MODEL_LEN}", "prompt")
        assert elapsed < 5.0, f"the refusal took {elapsed:.1f} s"


def test_deep_nesting_and_too_many_containers_are_400_not_500(doors):
    for content in (b"[" * 100_000, b'{"model": "tiny", "max_tokens": 2, "prompt": ' + b"[" * 100_000
                    + b"]" * 100_000 + b"}", b'{"a": ' * 100_000):
        assert_error(post(doors.url, content=content), 400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} "
                     "levels")
    many = b'{"model": "tiny", "max_tokens": 2, "prompt": [' + b"[9]," * MAX_JSON_CONTAINERS + b"[9]]}"
    assert_error(post(doors.url, content=many), 400, f"more than {MAX_JSON_CONTAINERS} arrays and objects")
    # brackets and escaped quotes inside a string are text, not nesting
    text = '\\"' + "[" * 200 + '"{' * 50 + "\\"
    ok = post(doors.url, {"prompt": text, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_a_body_over_the_limit_is_413_before_it_is_parsed(doors):
    too_big = b"[" * (DEFAULT_MAX_BODY_BYTES + 1)  # parsed, it would be a 400 for its nesting
    assert_error(post(doors.url, content=too_big), 413, f"over the limit of {DEFAULT_MAX_BODY_BYTES} bytes")
    chunked = httpx.post(f"{doors.url}/v1/completions", timeout=60,
                         content=iter([b"[" * (DEFAULT_MAX_BODY_BYTES // 2)] * 3))
    assert_error(chunked, 413, "over the limit")


# ----- max_tokens against the context -------------------------------------------------------------
@pytest.mark.parametrize(("prompt", "max_tokens", "fragment"), [
    ([5, 6, 8], MAX_MODEL_LEN, f"this model's context holds {MAX_MODEL_LEN} tokens"),
    ([5, 6, 8], 100_000_000, "max_tokens is 100000000"),
    (ids(2000, 1), 200, f"the prompt has 2000 tokens and this model's context holds {MAX_MODEL_LEN}: at most 48"),
    (ids(MAX_MODEL_LEN - 8, 2), 9, "at most 8 can be generated"),
])
def test_max_tokens_beyond_the_context_is_400_on_max_tokens(doors, prompt, max_tokens, fragment):
    assert_error(post(doors.url, {"prompt": prompt, "max_tokens": max_tokens}), 400, fragment, "max_tokens")


def test_max_tokens_that_just_fits_and_chat_beyond_the_context(doors):
    fits = post(doors.url, {"prompt": ids(MAX_MODEL_LEN - 8, 2), "max_tokens": 8, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 8, fits.text
    chat = post(doors.url, path="/v1/chat/completions", content=json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}).encode())
    assert_error(chat, 400, "max_tokens is 5000", "max_tokens")
    long_text = post(doors.url, {"prompt": "many words " * 4000, "max_tokens": 2})
    assert_error(long_text, 400, f"this model's context holds {MAX_MODEL_LEN}", "prompt")


# ----- every 4xx names its field --------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
ONE_FIELD = [
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF), ("temperature", 1e308),
    ("temperature", -1), ("top_p", NAN), ("top_p", 0), ("top_p", 1.5), ("min_p", NAN), ("min_p", 2),
    ("seed", 2**70), ("seed", -(2**70)), ("n", 0), ("n", 17), ("top_k", -5), ("presence_penalty", 0.5),
    ("frequency_penalty", NAN), ("max_tokens", "5"), ("max_tokens", 0), ("stop_token_ids", [9999]),
    ("logprobs", 2), ("echo", True), ("cache_salt", ""), ("stop", [""]),
    ("stream_options", {"include_usage": True}), ("prompt", []), ("prompt", [1, 2, 100000]),
    ("max_tokens", 10**400), ("max_tokens", -(10**400)), ("n", 10**400), ("top_k", -(10**400)),
    ("stop_token_ids", [10**400]), ("prompt", [5, 10**400]),
]


@pytest.mark.parametrize(("field", "value"), ONE_FIELD, ids=[f"{f}={v!r}"[:40] for f, v in ONE_FIELD])
def test_a_bad_value_is_400_naming_its_field(doors, field, value):
    answer = post(doors.url, {field: value})
    assert_error(answer, 400, "", field)
    assert len(answer.json()["error"]["message"]) < 200, "a 400-digit integer is shown by its size"


def test_a_seed_that_overflows_with_n_names_the_seed(doors):
    assert_error(post(doors.url, {"seed": 2**63 - 1, "n": 2}), 400, "seed must be <=", "seed")
    assert post(doors.url, {"seed": 2**63 - 2, "n": 2}).status_code == 200


def test_null_and_zero_penalties_are_taken(doors):
    for value in (None, 0, 0.0):  # OpenAI's clients send null for "none"
        answer = post(doors.url, {"presence_penalty": value, "frequency_penalty": value})
        assert answer.status_code == 200, answer.text


def test_a_tiny_temperature_is_greedy(doors):
    body = {"prompt": ids(30, 3), "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    greedy = post(doors.url, {**body, "temperature": 0})
    tiny = post(doors.url, {**body, "temperature": 1e-40})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]


# ----- one request failing in the engine ----------------------------------------------------------
GOOD = [ids(20, 16), ids(33, 12), ids(12, 13)]
"""Prompts whose greedy continuations never reach ``NAN_TOKEN`` (one that did would fail too)."""
BAD = ids(15, 14) + [NAN_TOKEN] + ids(10, 15)
STREAM_TOKENS = 200


async def stream(client: httpx.AsyncClient, prompt: list[int], started: asyncio.Event) -> tuple[list[int], str, float]:
    """A greedy stream of ``prompt``: its token ids, finish reason and when its last event came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    tokens, reason = [], ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            tokens += choice["token_ids"]
            reason = choice["finish_reason"] or reason
            started.set()
    return tokens, reason, time.perf_counter()


async def streams(url: str, bad: bool) -> tuple[list[tuple[list[int], str, float]], list, float]:
    """The ``GOOD`` streams at once; with ``bad``, once each has begun, ``BAD`` plainly and streamed."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        began = [asyncio.Event() for _ in GOOD]
        tasks = [asyncio.create_task(stream(client, p, e)) for p, e in zip(GOOD, began, strict=True)]
        bad_answers, bad_done = [], 0.0
        if bad:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in began)), 30)
            body = {"model": "tiny", "prompt": BAD, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            plain = client.post("/v1/completions", json=body)
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            bad_answers = list(await asyncio.gather(plain, streamed))
            bad_done = time.perf_counter()
        return list(await asyncio.gather(*tasks)), bad_answers, bad_done


def test_a_request_the_engine_fails_fails_alone(doors):
    alone, _, _ = asyncio.run(streams(doors.url, bad=False))
    assert [r for _, r, _ in alone] == ["length"] * 3 and all(len(t) == STREAM_TOKENS for t, _, _ in alone)
    before = {r: metric(doors.url, f'kvlayer_serve_requests_total{{finish_reason="{r}"}}')
              for r in ("error", "abort", "length")}

    good, (plain, streamed), bad_done = asyncio.run(streams(doors.url, bad=True))
    assert_error(plain, 500, "the engine failed on this request")
    assert streamed.status_code == 200
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "the engine failed on this request" in error["message"]
    assert all(done > bad_done for _, _, done in good), "the streams were still running when the bad one failed"
    assert [t for t, _, _ in good] == [t for t, _, _ in alone]
    assert [r for _, r, _ in good] == ["length"] * 3
    after = {r: metric(doors.url, f'kvlayer_serve_requests_total{{finish_reason="{r}"}}') for r in before}
    assert {r: after[r] - before[r] for r in before} == {"error": 2, "abort": 0, "length": 3}
    again = post(doors.url, {"prompt": GOOD[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True})
    assert again.json()["choices"][0]["token_ids"] == alone[0][0][:4], "the server goes on serving"
