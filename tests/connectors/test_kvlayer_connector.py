"""kvlayer plugged into the bundled engine: prefixes come back from kvlayer, tokens unchanged."""

from __future__ import annotations

import random

import pytest

from kvlayer.engine import LLM, SamplingParams

C = 16  # chunk size used here (the engine's block size is 16 too)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def conversation(turns: int = 4, seed: int = 0) -> list[list[int]]:
    """User messages of a multi-turn chat (token ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 45))] for _ in range(turns)]


def run_chat(llm: LLM, messages: list[list[int]], salt: str | None = None):
    """Each turn's prompt is the previous prompt + its answer + the new message."""
    history: list[int] = []
    outs = []
    for msg in messages:
        prompt = history + msg
        p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        out = llm.generate([p], GREEDY)[0]
        outs.append(out)
        history = prompt + list(out.outputs[0].token_ids)
    return outs


def make(model, kv_config=None, **kw) -> LLM:
    # The engine's own prefix cache is off, so every prefix has to come back from kvlayer.
    return LLM(model, num_gpu_blocks=128, enable_prefix_caching=False, kv_config=kv_config, **kw)


def tier_stat(llm: LLM, tier: str, name: str) -> int:
    return llm.kv_stats()["tiers"][tier][name]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    return [o.outputs[0].token_ids for o in run_chat(make(tiny_model_dir), conversation())]


@pytest.mark.parametrize("tier, kv", [
    ("cpu", {"chunk_size": C, "cpu_capacity": "4MiB"}),
    ("gpu", {"chunk_size": C, "cpu_capacity": 0, "gpu_capacity": "4MiB"}),
])
def test_multi_turn_exact_from_kvlayer(tiny_model_dir, baseline, tier, kv):
    llm = make(tiny_model_dir, kv)
    outs = run_chat(llm, conversation())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    expected = [0] + [len(o.prompt_token_ids) // C * C for o in outs[:-1]]
    got = [o.num_external_tokens for o in outs]
    assert got == expected, "every turn's earlier prompt must come back from kvlayer, chunk-aligned"
    assert sum(got) > 0
    assert tier_stat(llm, tier, "hit_tokens") == sum(got)
    llm.close()


def test_partial_prefix_hit(tiny_model_dir):
    llm = make(tiny_model_dir, {"chunk_size": C})
    base = list(range(100, 180))  # 5 chunks
    llm.generate([{"prompt_token_ids": base}], GREEDY)
    other = base[:40] + [7] * 40  # shares 2 full chunks and half of the 3rd
    out = llm.generate([{"prompt_token_ids": other}], GREEDY)[0]
    assert out.num_external_tokens == 32
    ref = make(tiny_model_dir).generate([{"prompt_token_ids": other}], GREEDY)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_short_prompt_and_unaligned_chunk_size(tiny_model_dir):
    # chunk_size need not be a multiple of block_size: chunks are copied slot by slot.
    llm = make(tiny_model_dir, {"chunk_size": 24})
    short = {"prompt_token_ids": list(range(3, 13))}
    assert llm.generate([short], GREEDY)[0].num_external_tokens == 0
    assert llm.generate([short], GREEDY)[0].num_external_tokens == 0
    prompt = {"prompt_token_ids": list(range(50, 130))}
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_external_tokens == 72
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_two_requests_sharing_a_prefix_in_one_batch(tiny_model_dir):
    shared = list(range(200, 264))
    ps = [{"prompt_token_ids": shared + [5, 6, 7]}, {"prompt_token_ids": shared + [8, 9]}]
    ref = [o.outputs[0].token_ids for o in make(tiny_model_dir).generate(ps, GREEDY)]
    llm = make(tiny_model_dir, {"chunk_size": C})
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY)] == ref
    again = llm.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == ref
    assert [o.num_external_tokens for o in again] == [64, 64]


def test_cache_salt_isolates_tenants(tiny_model_dir):
    llm = make(tiny_model_dir, {"chunk_size": C})
    p = list(range(300, 380))
    llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-a"}], GREEDY)
    b = llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-b"}], GREEDY)[0]
    a = llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-a"}], GREEDY)[0]
    none = llm.generate([{"prompt_token_ids": p}], GREEDY)[0]
    assert b.num_external_tokens == 0
    assert none.num_external_tokens == 0
    assert a.num_external_tokens == 79  # 5 full chunks, less the one token the engine must compute
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == none.outputs[0].token_ids


def test_capacity_and_references(tiny_model_dir):
    cap_chunks = 6
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": f"{cap_chunks * 2 * 2 * C * 2 * 16 * 4}"})
    conn = llm.engine.connector
    cpu = next(b for b in conn.kv.backends if b.name == "cpu")
    rng = random.Random(5)
    for _ in range(12):  # ~10x the tier's capacity
        p = [rng.randrange(3, 500) for _ in range(80)]
        llm.generate([{"prompt_token_ids": p}], GREEDY)
        used, capacity = cpu.usage()
        assert used <= capacity
    conn.kv.flush()
    assert conn.kv.staging.used_count == 0, "staging memory leaked"
    assert tier_stat(llm, "cpu", "evictions") > 0
    llm.close()


@pytest.mark.parametrize("mode, kv, layerwise", [
    ("auto", {"cpu_capacity": "4MiB"}, [False]),  # chunks in memory: copied before the forward pass
    ("auto", {"cpu_capacity": 0, "nvme_path": "{tmp}"}, [True]),  # read from disk: layer by layer
    ("on", {"cpu_capacity": "4MiB"}, [True]),
    ("off", {"cpu_capacity": 0, "nvme_path": "{tmp}"}, [False]),
])
def test_layerwise_auto_streams_only_loads_from_lower_tiers(tiny_model_dir, tmp_path, monkeypatch, mode, kv,
                                                             layerwise):
    import kvlayer.step as connector  # where the step layer builds its LoadJob

    seen: list[bool] = []
    real = connector.LoadJob

    def recording(*args, **kw):
        seen.append(args[5] is not None)  # the loader executor: layer by layer
        return real(*args, **kw)

    monkeypatch.setattr(connector, "LoadJob", recording)
    cfg = {k: (str(tmp_path) if v == "{tmp}" else v) for k, v in kv.items()}
    llm = make(tiny_model_dir, {"chunk_size": C, "layerwise": mode, **cfg})
    prompt = {"prompt_token_ids": conversation(1)[0] * 2}
    first = llm.generate([prompt], GREEDY)[0]
    llm.engine.connector.kv.flush()
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_external_tokens > 0 and second.outputs[0].token_ids == first.outputs[0].token_ids
    assert seen == layerwise
