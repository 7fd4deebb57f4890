"""Bad input to ``kvlayer serve`` is a 4xx with OpenAI's error JSON and a one-line message, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.serving.conftest import BODY_LIMIT, MAX_MODEL_LEN, random_ids


def post(server, body: object = None, content: bytes | None = None, path: str = "/v1/completions") -> httpx.Response:
    if content is not None:
        return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"},
                          timeout=30)
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def assert_error(r: httpx.Response, status: int, fragment: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"], error
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param


CASES = [
    ({"max_tokens": -1}, 400, "max_tokens must be >= 1", "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens must be >= 1", "max_tokens"),
    ({"max_tokens": None}, 400, "max_tokens is required", "max_tokens"),
    ({"max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ({"prompt": [1, 2, 100000]}, 400, "token id 100000 is outside the vocabulary [0, 512)", "prompt"),
    ({"prompt": [1, -2]}, 400, "token id -2 is outside the vocabulary", "prompt"),
    ({"prompt": []}, 400, "prompt must not be an empty list", None),
    ({"prompt": ""}, 400, "the prompt is empty", "prompt"),
    ({"prompt": {"text": "x"}}, 400, "prompt", "prompt"),
    ({"prompt": None}, 400, "prompt", "prompt"),
    ({"model": "other"}, 404, "the model 'other' does not exist", "model"),
    ({"temperature": -1}, 400, "temperature must be >= 0", None),
    ({"top_p": 0}, 400, "top_p must be in (0, 1]", None),
    ({"top_k": -5}, 400, "top_k must be -1, 0 (off) or positive", "top_k"),
    ({"n": 0}, 400, "n must be in 1..16", None),
    ({"logprobs": 2}, 400, "logprobs is not supported", None),
    ({"echo": True}, 400, "echo is not supported", None),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options needs stream: true", None),
    ({"stop_token_ids": [9999]}, 400, "stop_token_ids: 9999 is outside the vocabulary", "stop_token_ids"),
    ({"cache_salt": ""}, 400, "cache_salt must not be empty", None),
    ({"stop": [""]}, 400, "a stop string must not be empty", None),
    ({"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, 400,
     "kv_transfer_params.do_remote_decode needs stream: false", None),
]


@pytest.mark.parametrize(("change", "status", "fragment", "param"), CASES)
def test_bad_fields(server, tiny_model_dir, change, status, fragment, param):
    body = {"model": tiny_model_dir, "prompt": [5, 6, 7], "max_tokens": 2, **change}
    if change.get("max_tokens", 0) is None:
        del body["max_tokens"]
    assert_error(post(server, body), status, fragment, param)


def test_a_prompt_longer_than_the_context(server, tiny_model_dir):
    body = {"model": tiny_model_dir, "prompt": random_ids(MAX_MODEL_LEN, seed=1), "max_tokens": 2}
    assert_error(post(server, body), 400, f"this model's context holds {MAX_MODEL_LEN}", "prompt")


def test_malformed_json_and_non_object_bodies(server):
    assert_error(post(server, content=b'{"model": '), 400, "malformed JSON body")
    assert_error(post(server, content=b"\xff\xfe"), 400, "malformed JSON body")
    assert_error(post(server, content=b"[1, 2]"), 400, "the body must be a JSON object, got list")


def test_a_body_over_the_limit_is_413(server, tiny_model_dir):
    body = {"model": tiny_model_dir, "prompt": "x" * BODY_LIMIT, "max_tokens": 2}
    assert_error(post(server, body), 413, f"over the limit of {BODY_LIMIT} bytes")
    chunked = httpx.post(f"{server.url}/v1/completions", content=iter([b"{" + b" " * 40000, b" " * 40000 + b"}"]),
                         timeout=30)
    assert_error(chunked, 413, "over the limit")


def test_unknown_routes_and_methods(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404, "no such route")
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405, "method not allowed")


def test_chat_errors(server, tiny_model_dir):
    chat = "/v1/chat/completions"
    assert_error(post(server, {"model": tiny_model_dir, "messages": [], "max_tokens": 2}, path=chat), 400,
                 "messages")
    assert_error(post(server, {"model": tiny_model_dir, "messages": [{"role": "wizard", "content": "x"}],
                               "max_tokens": 2}, path=chat), 400, "messages.0.role")
    assert_error(post(server, {"model": tiny_model_dir, "messages": [{"role": "user", "content": "x"}]},
                      path=chat), 400, "max_tokens is required")
    ok = post(server, {"model": tiny_model_dir, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 2}, path=chat)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_the_server_still_serves_after_bad_requests(server, tiny_model_dir):
    r = post(server, {"model": tiny_model_dir, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
