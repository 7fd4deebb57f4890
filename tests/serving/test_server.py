"""``kvlayer serve`` against a real server process: prompts, streaming, concurrency, caches, aborts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvlayer.serving.chat import FALLBACK_TEMPLATE, ChatTemplate
from tests.serving.conftest import greedy, metric, random_ids, wait_until_idle


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def stream_completion(url: str, body: dict) -> tuple[list[dict], list[int], str]:
    """POST a streamed completion; returns its chunks, the concatenated token ids and text."""
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    return chunks, ids, text


def test_models_health_and_the_default_name(server, tiny_model_dir):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [tiny_model_dir]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_text_token_and_chat_prompts_through_the_openai_client(server, reference, tiny_model_dir):
    c = client(server)
    extra = {"return_token_ids": True, "ignore_eos": True}
    text = c.completions.create(model=tiny_model_dir, prompt="The cache is warm", max_tokens=8, temperature=0,
                                extra_body=extra)
    ids = random_ids(40, seed=1)
    by_ids = c.completions.create(model=tiny_model_dir, prompt=ids, max_tokens=8, temperature=0, extra_body=extra)
    want_text, want_ids = greedy(reference, ["The cache is warm", ids], 8)
    assert text.choices[0].model_extra["token_ids"] == want_text
    assert text.choices[0].text == reference.tokenizer.decode(want_text)
    assert text.choices[0].model_extra["prompt_token_ids"] == reference.tokenizer.encode("The cache is warm")
    assert by_ids.choices[0].model_extra["token_ids"] == want_ids
    assert text.usage.prompt_tokens == len(reference.tokenizer.encode("The cache is warm"))
    assert by_ids.usage.completion_tokens == 8 and text.choices[0].finish_reason == "length"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = c.chat.completions.create(model=tiny_model_dir, messages=messages, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert ChatTemplate.from_dir(tiny_model_dir).fallback
    rendered = ChatTemplate(FALLBACK_TEMPLATE).render(messages)
    assert rendered == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    want_chat = greedy(reference, [rendered], 6)[0]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == reference.tokenizer.decode(want_chat)
    assert chat.usage.prompt_tokens == len(reference.tokenizer.encode(rendered))


def test_streamed_equals_not_streamed_equals_in_process(server, reference, tiny_model_dir):
    ids = random_ids(70, seed=2)
    body = {"model": tiny_model_dir, "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    chunks, streamed, text = stream_completion(server.url, {**body, "stream_options": {"include_usage": True}})
    want = greedy(reference, [ids], 20)[0]
    assert plain["choices"][0]["token_ids"] == streamed == want
    assert text == plain["choices"][0]["text"] == reference.tokenizer.decode(want)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_32_concurrent_streams_sharing_prefixes_are_exact(server, reference, tiny_model_dir):
    shared = [random_ids(48, seed=10 + k) for k in range(4)]
    prompts = [shared[i % 4] + random_ids(5 + i, seed=100 + i) for i in range(32)]

    async def one(c: openai.AsyncOpenAI, prompt: list[int]) -> list[int]:
        got = []
        stream = await c.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
        async for chunk in stream:
            got += chunk.choices[0].model_extra.get("token_ids") or []
        return got

    async def all_of_them() -> list[list[int]]:
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all_of_them()) == greedy(reference, prompts, 12)


def ttft(url: str, body: dict) -> tuple[float, dict]:
    """Seconds to the first streamed token, and the usage of the streamed answer."""
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None and '"token_ids": [' in line:
                first = time.perf_counter() - start
            if '"usage": {' in line:
                usage = json.loads(line.removeprefix("data: "))["usage"]
    assert first is not None
    return first, usage


def test_a_repeated_long_prefix_reports_cached_tokens_and_is_faster(server, tiny_model_dir):
    prefix = random_ids(1900, seed=3)
    body = {"model": tiny_model_dir, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    cold, cold_usage = ttft(server.url, {**body, "prompt": prefix + [7, 8]})
    warm = [ttft(server.url, {**body, "prompt": prefix + [9, k]}) for k in (10, 11)]
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 1888 for _, u in warm)  # 118 blocks of 16
    assert min(t for t, _ in warm) < cold, f"hits {[t for t, _ in warm]} s vs cold {cold} s"


def test_n_seeds_and_stop_strings(server, reference, tiny_model_dir):
    c = client(server)
    ids = random_ids(30, seed=4)
    two = c.completions.create(model=tiny_model_dir, prompt=[ids, ids[:20]], n=2, max_tokens=5, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True})
    want = greedy(reference, [ids, ids[:20]], 5)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
    assert [ch.model_extra["token_ids"] for ch in two.choices] == [want[0], want[0], want[1], want[1]]
    assert two.usage.prompt_tokens == 50 and two.usage.completion_tokens == 20
    sampled = [c.completions.create(model=tiny_model_dir, prompt=ids, max_tokens=8, temperature=1.0, seed=7,
                                    extra_body={"return_token_ids": True, "ignore_eos": True}) for _ in range(2)]
    assert sampled[0].choices[0].model_extra["token_ids"] == sampled[1].choices[0].model_extra["token_ids"]

    full = c.completions.create(model=tiny_model_dir, prompt="abc", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]
    cut = c.completions.create(model=tiny_model_dir, prompt="abc", max_tokens=12, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    _, _, streamed = stream_completion(server.url, {"model": tiny_model_dir, "prompt": "abc", "max_tokens": 12,
                                                    "temperature": 0, "stop": stop, "ignore_eos": True})
    assert streamed == cut.text


def test_metrics_carry_serving_and_kvlayer_series(server, tiny_model_dir):
    client(server).completions.create(model=tiny_model_dir, prompt=random_ids(40, seed=5), max_tokens=3,
                                      temperature=0)
    assert metric(server.url, "kvlayer_serve_time_to_first_token_seconds_count") >= 1
    assert metric(server.url, "kvlayer_serve_inter_token_latency_seconds_count") >= 2
    assert metric(server.url, "kvlayer_serve_generation_tokens_total") >= 3
    assert metric(server.url, 'kvlayer_serve_requests_total{finish_reason="length"}') >= 1
    assert metric(server.url, f'kvlayer_put_chunks_total{{instance="{_instance(server)}",tier="cpu"}}') >= 2


def _instance(server) -> str:
    text = httpx.get(f"{server.url}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("kvlayer_put_chunks_total{"))
    return line.split('instance="')[1].split('"')[0]


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_disconnects_aborts_its_request(server, tiny_model_dir, streamed):
    finished = 'kvlayer_serve_requests_total{finish_reason="length"}'
    aborts = 'kvlayer_serve_requests_total{finish_reason="abort"}'
    before = {name: metric(server.url, name) for name in (finished, aborts, "kvlayer_serve_generation_tokens_total")}
    body = {"model": tiny_model_dir, "prompt": random_ids(60, seed=6), "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": streamed}
    if streamed:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # a token arrived: the request runs; now leave
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    idle = wait_until_idle(server.url)
    assert not any(idle.values()), idle
    assert metric(server.url, aborts) == before[aborts] + 1
    assert metric(server.url, finished) == before[finished], "the request ran to its end instead"
    generated = "kvlayer_serve_generation_tokens_total"
    assert metric(server.url, generated) == before[generated]
    assert metric(server.url, "kvlayer_serve_kv_blocks") > 0
