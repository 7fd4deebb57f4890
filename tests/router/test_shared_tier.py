"""The shared tier behind a fleet: prefill/decode disaggregation through Redis, and a Redis
Cluster node lost while instances read from it."""

from __future__ import annotations

from tests.redis_server import RedisClusterNodes, RedisServer
from tests.router.conftest import complete, fleet, random_ids


def tokens(answer) -> list[int]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def test_prefill_on_one_instance_decode_on_another_through_redis(model, tmp_path, reference):
    with RedisServer() as redis, fleet(model, tmp_path, router_args=("--pd",), redis_url=redis.url,
                                       instance_args={"a": ("--role", "prefill"), "b": ("--role", "decode")}) as f:
        for seed in (21, 22):
            prompt = random_ids(100, seed=seed)
            answer = complete(f["router"].url, prompt, max_tokens=12)
            assert answer.headers["x-kvlayer-prefill-instance"] == "a"
            assert answer.headers["x-kvlayer-instance"] == "b"
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96, "loaded from Redis"
            assert tokens(answer) == reference_tokens(reference, prompt, 12)
        stream = complete(f["router"].url, random_ids(60, seed=23), max_tokens=5, stream=True)
        assert stream.headers["x-kvlayer-instance"] == "b" and stream.text.rstrip().endswith("data: [DONE]")


def reference_tokens(llm, prompt: list[int], n: int) -> list[int]:
    from tests.serving.conftest import greedy

    return greedy(llm, [prompt], n)[0]


def test_a_chunk_stored_by_one_instance_hits_for_another_and_a_dead_cluster_node_only_misses(model, tmp_path):
    with RedisClusterNodes() as cluster, fleet(model, tmp_path, redis_url=cluster.url, redis_cluster="true",
                                               tier_timeout_ms=500,
                                               instance_args={"a": ("--no-prefix-caching",),
                                                              "b": ("--no-prefix-caching",)}) as f:
        prompts = [random_ids(100, seed=30 + k) for k in range(8)]
        want = [tokens(complete(f["a"].url, p, max_tokens=6)) for p in prompts]  # stored by a
        first = complete(f["b"].url, prompts[0], max_tokens=6)
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96, "b hits what a stored"
        assert tokens(first) == want[0]

        cluster.nodes[1].kill()
        cached = []
        for p, w in zip(prompts[1:], want[1:]):
            answer = complete(f["b"].url, p, max_tokens=6)
            assert tokens(answer) == w, "a lost node is a miss, never wrong KV or a failed request"
            cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert 0 < sum(cached) < 96 * len(cached), f"some keys lived on the dead node, the others still hit: {cached}"
