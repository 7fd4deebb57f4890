"""Two real ``kvlayer serve`` processes as clients of one ``kvlayer cache-server``: a prompt one
of them served is a hit from the shared arena in the other, with the same greedy tokens."""

from __future__ import annotations

import httpx

from tests.serve_process import ServeProcess
from tests.serving.conftest import random_ids, write_kv_config


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0.0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_serve_processes_share_the_servers_arena(server, tiny_model_dir, tmp_path) -> None:
    config = write_kv_config(tmp_path, cache_server=server.socket_path, cpu_capacity=0, chunk_size=16)
    args = ("--kv-config", config, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
            "--no-prefix-caching")
    prompt = random_ids(100, seed=27)
    with ServeProcess(tiny_model_dir, *args) as first, ServeProcess(tiny_model_dir, *args) as second:
        miss = _complete(first.url, prompt)
        assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        stats = server.wait_stats(lambda s: s.chunks == 6)  # 96 of the 100 tokens, whole chunks of 16
        hit = _complete(second.url, prompt)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 96, "a hit from the other process's store"
        assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
        assert hit["usage"]["completion_tokens"] == miss["usage"]["completion_tokens"] == 8
        with server.client() as c:
            after = c.stats()
        assert after.chunks == stats.chunks == 6, "one copy: the second process stored nothing again"
