"""Fuzzing of the HTTP API of ``kvlayer serve`` (serving/), in process (``http_app``).

Bodies for ``/v1/completions`` and ``/v1/chat/completions``: objects whose every field is
left out, right, or any JSON value of any type (NaN and infinities included), random JSON
values, raw bytes, and damaged good bodies; a few go to the other routes. Every answer is a
success or a 4xx, within a per-request timeout; every error body is one line of JSON in
OpenAI's error shape; a stream ends with ``[DONE]`` and carries no error event; the server
answers a good request exactly afterwards. Nothing is filtered out. Run:
``.venv/bin/python -m pytest tests/fuzz/test_fuzz_http.py`` (``-m slow``: the full counts).
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
from hypothesis import strategies as st

from tests.fuzz.budget import budget, explore
from tests.fuzz.conftest import MODEL, AppClient

VOCAB = 512
"""The tiny model's vocabulary."""

ints = st.integers() | st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63, -(2**63) - 1, 10**40])
floats = st.floats() | st.sampled_from([0.0, -0.0, 1e-40, 1e-5, 1e308, float("nan"), float("inf"), -float("inf")])
scalars = st.none() | st.booleans() | ints | floats | st.text(max_size=12)
any_json = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                            max_size=4),
                        max_leaves=12)
"""Any JSON value (Python's encoder writes NaN and infinities, and the server's decoder reads them)."""

token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
texts = st.text(min_size=1, max_size=30)
prompts = texts | token_ids | st.lists(texts, min_size=1, max_size=3) | st.lists(token_ids, min_size=1, max_size=3)
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)}), max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": st.none() | st.text(max_size=30) | parts},
    optional={"name": st.text(max_size=8)}), min_size=1, max_size=3)
unit = st.floats(0.0, 1.0)

GOOD = {
    "model": st.just(MODEL), "max_tokens": st.integers(1, 3), "temperature": st.sampled_from([0.0, 1.0]) | unit,
    "top_p": st.floats(0.01, 1.0), "top_k": st.sampled_from([-1, 0, 1, 5, 50]), "min_p": unit,
    "presence_penalty": st.just(0.0), "frequency_penalty": st.just(0.0), "seed": st.integers(0, 2**31),
    "stop": st.none() | texts | st.lists(texts, max_size=2), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1),
                                                                                        max_size=3),
    "n": st.integers(1, 3), "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}), "cache_salt": texts, "return_token_ids": st.booleans(),
    "ignore_eos": st.booleans(), "user": st.text(max_size=8), "kv_transfer_params": st.just({}),
    "logprobs": st.none(), "echo": st.just(False), "logit_bias": st.none(),
}
ENDPOINTS = {"/v1/completions": {"prompt": prompts}, "/v1/chat/completions": {
    "messages": messages, "max_completion_tokens": st.integers(1, 3), "add_generation_prompt": st.booleans()}}
REQUIRED = {"model", "max_tokens", "prompt", "messages"}


@st.composite
def field_bodies(draw: st.DrawFn, path: str) -> bytes:
    """An object of the endpoint's fields, each left out, right, or (in a noisy body: half of
    them) any JSON value (about 1 in 12); a clean body sends ``stream_options`` only with a stream."""
    fields = {**GOOD, **ENDPOINTS[path]}
    noisy = draw(st.booleans())
    body: dict[str, object] = {}
    for name, good in fields.items():
        roll = draw(st.integers(0, 11))
        if roll == 0 and noisy:
            body[name] = draw(any_json)
        elif roll >= 4 or (name in REQUIRED and roll >= 1):
            body[name] = draw(good)
    if not noisy and body.get("stream") is not True:
        body.pop("stream_options", None)
    body.update(draw(st.dictionaries(st.text(max_size=8), any_json, max_size=2)))  # unknown fields
    if draw(st.booleans()):  # a field order of its own
        body = dict(draw(st.permutations(list(body.items()))))
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def damaged(draw: st.DrawFn, path: str) -> bytes:
    data = bytearray(draw(field_bodies(path)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[draw(st.integers(0, len(data))):]
        else:
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.sampled_from([b"[", b"{", b'"', b"\\", b"\xff", b"NaN", b"-", b"1e999"])
                               | st.binary(min_size=1, max_size=8))
    return bytes(data)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    """``(method, path, body, headers)``: mostly a generation request, now and then another route."""
    route = draw(st.sampled_from([("POST", p) for p in ENDPOINTS] * 6 + [
        ("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/models"), ("POST", "/v1/nothing"),
        ("GET", "/v1/completions")]))
    method, path = route
    kind = draw(st.sampled_from(["fields"] * 6 + ["json", "raw", "damaged", "damaged"]))
    if kind == "fields" and path in ENDPOINTS:
        body = draw(field_bodies(path))
    elif kind == "damaged" and path in ENDPOINTS:
        body = draw(damaged(path))
    elif kind == "raw":
        body = draw(st.binary(max_size=80))
    else:
        body = json.dumps(draw(any_json), allow_nan=True).encode()
    headers = {"content-type": draw(st.sampled_from(["application/json"] * 8 + ["text/plain", ""]))}
    return method, path, body, headers


def error_shape(r: httpx.Response) -> None:
    """A one-line JSON body ``{"error": {message, type, param, code}}``, code the status."""
    assert "\n" not in r.text, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, r.text
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"], r.text
    assert isinstance(error["type"], str) and error["code"] == r.status_code, r.text
    assert error["param"] is None or isinstance(error["param"], str), r.text


def answer_shape(r: httpx.Response) -> None:
    """A 200: JSON with choices, or an event stream of JSON chunks ending ``[DONE]``, no error in it."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", r.text[-300:]
        for e in events[:-1]:
            assert e.startswith("data: ") and "\n" not in e, e
            chunk = json.loads(e[6:])
            assert "error" not in chunk, f"an error event in a stream: {e}"
        return
    body = r.json()
    assert isinstance(body, dict) and body, r.text


OUTCOMES: Counter[tuple[str, int]] = Counter()


def check_request(http_app: AppClient, request: tuple[str, str, bytes, dict[str, str]]) -> None:
    method, path, body, headers = request
    r = http_app.request(method, path, body, headers)
    OUTCOMES[path, r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code} for {method} {path} {body!r}: {r.text}"
    if r.status_code == 200:
        answer_shape(r)
    else:
        error_shape(r)


def good_request_still_served(http_app: AppClient) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    r = http_app.request("POST", "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert http_app.request("GET", "/health", b"").json() == {"status": "ok"}


@budget(ci=700)
def test_http_requests(examples: int, http_app: AppClient) -> None:
    OUTCOMES.clear()
    explore(examples, check_request, requests(), http_app=http_app)
    good_request_still_served(http_app)
    print(f"fuzzed {sum(OUTCOMES.values())} requests: {sorted(OUTCOMES.items())}")
    ok = sum(n for (path, status), n in OUTCOMES.items() if path in ENDPOINTS and status == 200)
    refused = sum(n for (path, status), n in OUTCOMES.items() if path in ENDPOINTS and status == 400)
    assert ok > examples // 20 and refused > examples // 20, "the fuzz must reach both answers and refusals"

