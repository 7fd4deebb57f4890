"""``kvlayer serve`` with API keys, kvlayer as the only cache, a model without a tokenizer, a short queue."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.serve_process import ServeProcess
from tests.serving.conftest import greedy, random_ids, write_kv_config
from tests.serving.test_server_errors import assert_error

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def locked(no_tokenizer_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-locked")
    keys = folder / "keys"
    keys.write_text(f"# the test's keys\n\n{KEY}\nsk-other\n", encoding="utf-8")
    config = write_kv_config(folder, cpu_capacity="32MiB", chunk_size=16)
    with ServeProcess(no_tokenizer_model, "--kv-config", config, "--api-key-file", str(keys), "--no-prefix-caching",
                      "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-waiting", "2",
                      "--kv-cache-memory", "64MiB") as proc:
        yield proc


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(url: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, headers=auth(key), timeout=60)


def test_the_api_key_is_enforced(locked):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    assert_error(httpx.post(f"{locked.url}/v1/completions", json=body), 401, "a valid API key is required")
    assert_error(completion(locked.url, body, key="sk-wrong"), 401, "a valid API key is required")
    basic = httpx.post(f"{locked.url}/v1/completions", json=body, headers={"Authorization": f"Basic {KEY}"})
    assert_error(basic, 401, "API key")
    assert_error(httpx.get(f"{locked.url}/v1/models"), 401, "API key")
    assert completion(locked.url, body).status_code == 200
    assert completion(locked.url, body, key="sk-other").status_code == 200
    assert httpx.get(f"{locked.url}/health").status_code == 200  # probes need no key
    c = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_kvlayer_hits_count_as_cached_tokens_and_give_the_same_tokens(locked, reference):
    ids = random_ids(100, seed=21)
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    first, second = completion(locked.url, body).json(), completion(locked.url, body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 chunks of 16; the engine's cache is off
    want = greedy(reference, [ids], 6)[0]
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == want
    salted = completion(locked.url, {**body, "cache_salt": "tenant-b"}).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "another tenant must not hit"
    assert salted["choices"][0]["token_ids"] == want


def test_text_needs_a_tokenizer(locked):
    assert_error(completion(locked.url, {"prompt": "hello", "max_tokens": 2}), 400,
                 "a text prompt needs a tokenizer.json", "prompt")
    assert_error(completion(locked.url, {"prompt": [5, 6], "max_tokens": 2, "stop": "x"}), 400,
                 "stop strings need a tokenizer.json")
    chat = httpx.post(f"{locked.url}/v1/chat/completions", headers=auth(), timeout=30,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert_error(chat, 400, "chat needs a tokenizer.json")


def test_past_max_waiting_requests_get_503_and_the_rest_are_served(locked):
    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        return await c.post(f"{locked.url}/v1/completions", headers=auth(), json={
            "model": "tiny", "prompt": random_ids(20, seed=i), "max_tokens": 200, "temperature": 0,
            "ignore_eos": True})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    answers = asyncio.run(burst())
    codes = sorted(r.status_code for r in answers)
    # queued = submitted and not yet running: at least the 2 the queue holds get in (a third may, once the
    # first runs), the rest are refused at once
    assert codes.count(503) >= 1 and codes.count(200) >= 2 and set(codes) == {200, 503}, codes
    refused = next(r for r in answers if r.status_code == 503)
    assert_error(refused, 503, "already waiting (--max-waiting 2)")
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in answers if r.status_code == 200)


def test_a_server_that_joins_the_controller_registers_its_base_url(no_tokenizer_model, tmp_path):
    from kvlayer.controller.client import AdminClient
    from tests.controller.harness import ServerThread, wait_until

    with ServerThread() as controller, AdminClient(controller.address, timeout=10) as admin:
        env = {"KVLAYER_CONTROLLER_URL": controller.address, "KVLAYER_INSTANCE_ID": "serve-a"}
        with ServeProcess(no_tokenizer_model, "--kv-cache-memory", "64MiB", env=env) as server:
            def registered() -> bool:
                return any(i.instance_id == "serve-a" for i in admin.list_instances().instances)

            wait_until(registered, what="the server's registration")
            found = next(i for i in admin.list_instances().instances if i.instance_id == "serve-a")
    assert found.address == server.url
