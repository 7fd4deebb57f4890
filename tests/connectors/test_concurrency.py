"""Many requests loading and saving at once, layer by layer or not: the tokens never change."""

from __future__ import annotations

import random

import pytest

from kvlayer.engine import LLM, SamplingParams
from tests.connectors.test_kvlayer_connector import C

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompts(n: int = 64, seed: int = 0) -> list[dict]:
    """``n`` prompts over 4 shared prefixes (3-5 chunks), each with its own suffix; some repeat."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(C * rng.randrange(3, 6))] for _ in range(4)]
    out = []
    for i in range(n):
        suffix = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 2 * C))] if i % 8 else []
        out.append({"prompt_token_ids": prefixes[i % 4] + suffix + [i % 7 + 3]})
    return out


def make(model: str, kv: dict | None) -> LLM:
    # A small engine cache (preemptions) and no engine prefix cache: prefixes come from kvlayer.
    return LLM(model, num_gpu_blocks=96, max_num_seqs=64, max_num_batched_tokens=512,
               enable_prefix_caching=False, kv_config=kv)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = make(tiny_model_dir, None)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS)]


@pytest.mark.parametrize("layerwise", [True, False])
def test_64_concurrent_requests_over_shared_prefixes(tiny_model_dir, reference, layerwise):
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": "16MiB", "layerwise": layerwise})
    first = llm.generate(prompts(), PARAMS)  # stores while others load what was just stored
    second = llm.generate(prompts(), PARAMS)  # every prefix now comes back, many at once
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert sum(o.num_external_tokens for o in first) > 0, "later requests of the first batch hit earlier ones"
    assert all(o.num_external_tokens >= C * 3 for o in second)
    stats = llm.kv_stats()["tiers"]["cpu"]
    # >=: a request preempted after its load loads again when it is re-admitted.
    assert stats["hit_tokens"] >= sum(o.num_external_tokens for o in first + second)
    assert llm.engine.connector.kv.staging.used_count == 0
    assert llm.engine.scheduler.num_preemptions > 0, "the engine cache is meant to be too small"
    llm.close()


def test_64_concurrent_requests_streaming_layers_from_disk(tiny_model_dir, reference, tmp_path, monkeypatch):
    """The same over the NVMe tier alone, each load streamed one layer at a time."""
    from kvlayer import read_plan

    monkeypatch.setattr(read_plan, "MIN_GROUP_BYTES", 1)
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(tmp_path)})
    first = llm.generate(prompts(), PARAMS)
    assert llm.engine.connector.kv.tiers.flush(30)
    second = llm.generate(prompts(), PARAMS)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert all(o.num_external_tokens >= C * 3 for o in second)
    assert llm.kv_stats()["tiers"]["nvme"]["checksum_errors"] == 0
    assert llm.engine.connector.kv.staging.used_count == 0
    llm.close()
