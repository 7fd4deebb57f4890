"""End-to-end behaviour of the bundled engine on a tiny random model (CPU, float32)."""

from __future__ import annotations

import random

import pytest

from kvlayer.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, vocab: int = 500) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 90))]}
            for _ in range(n)]


def tokens(outs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=256)


def test_batch_equals_each_alone(llm):
    ps = prompts(16)
    batched = tokens(llm.generate(ps, GREEDY))
    llm.reset_prefix_cache()
    alone = []
    for p in ps:
        alone += tokens(llm.generate([p], GREEDY))
        llm.reset_prefix_cache()
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    assert len({t for t in batched}) > 1, "a random model should not answer every prompt alike"


def test_prefix_cache_hit_gives_same_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_gpu_blocks=128)
    p = {"prompt_token_ids": list(range(10, 90))}
    miss = llm.generate([p], GREEDY)[0]
    hit = llm.generate([p], GREEDY)[0]
    assert miss.num_cached_tokens == 0
    assert hit.num_cached_tokens == 64  # 80 tokens: 4 full blocks, the 5th holds the last token
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    longer = {"prompt_token_ids": list(range(10, 90)) + [5, 6, 7] * 10}
    assert llm.generate([longer], GREEDY)[0].num_cached_tokens == 80


def test_chunked_prefill_equals_one_shot(tiny_model_dir):
    ps = prompts(6, seed=1)
    one = LLM(tiny_model_dir, num_gpu_blocks=256, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = LLM(tiny_model_dir, num_gpu_blocks=256, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert tokens(one.generate(ps, GREEDY)) == tokens(chunked.generate(ps, GREEDY))


def test_preemption_gives_same_tokens(tiny_model_dir):
    ps = prompts(8, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(tiny_model_dir, num_gpu_blocks=256)
    tight = LLM(tiny_model_dir, num_gpu_blocks=14)
    expected = tokens(roomy.generate(ps, params))
    assert tokens(tight.generate(ps, params)) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert roomy.engine.scheduler.num_preemptions == 0
    assert tight.engine.block_manager.num_free_blocks == 14


def test_sampling_seed_is_reproducible(llm):
    p = prompts(1, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    a = tokens(llm.generate(p, params))
    b = tokens(llm.generate(p, params))
    c = tokens(llm.generate(p, SamplingParams(max_tokens=10, temperature=0.8, seed=8, ignore_eos=True)))
    assert a == b
    assert a != c


def test_stop_tokens_and_lengths(llm):
    p = prompts(1, seed=4)
    first = llm.generate(p, GREEDY)[0].outputs[0]
    stop_at = first.token_ids[3]
    out = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]
    assert first.finish_reason == "length"


def test_text_prompt_and_metrics(llm):
    out = llm.generate("hello kvlayer", SamplingParams(max_tokens=4, temperature=0))[0]
    assert isinstance(out.outputs[0].text, str)
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "empty prompt"),
    ({"prompt_token_ids": [1, 10**6]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 5000}, "context"),
    ({"prompt": "x"}, "prompt_token_ids"),
    (42, "string or a dict"),
])
def test_bad_prompts_are_clear_errors(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_missing_model_folder(tmp_path):
    with pytest.raises(Exception, match="config.json|not found|does not exist|no such"):
        LLM(str(tmp_path / "nope"))


def test_an_unavailable_device_is_a_value_error_naming_it(tiny_model_dir, monkeypatch):
    import torch

    from kvlayer.engine.config import parse_device

    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        LLM(tiny_model_dir, device="gpu")
    with pytest.raises(ValueError, match="'mps' is not supported"):
        parse_device("mps")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)  # a CPU-only torch build
    with pytest.raises(ValueError, match="device 'cuda' is not available: this torch build has no CUDA"):
        LLM(tiny_model_dir, device="cuda")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda:0' is not available: no CUDA GPU is visible"):
        parse_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 'cuda:1' is not available: 1 CUDA GPU\(s\) visible"):
        parse_device("cuda:1")
    assert parse_device("cuda:0") == torch.device("cuda", 0) and parse_device("cpu") == torch.device("cpu")
