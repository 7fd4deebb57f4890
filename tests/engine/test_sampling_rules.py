"""Sampling and stopping rules: EOS from the model's config, top-k, top-p and per-request seeds.

Run: ``.venv/bin/python -m pytest tests/engine/test_sampling_rules.py``. Engine tests use the tiny
random model on the CPU in float32; filter tests call ``sample`` on hand-made logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvlayer.engine import LLM, SamplingParams
from kvlayer.engine.sampling import sample_each

PROMPTS = [{"prompt_token_ids": list(range(start, start + 20))} for start in (40, 140, 300)]
MAX_TOKENS = 6


def tokens(outs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=64)


@pytest.fixture(scope="module")
def greedy(llm) -> list[tuple[int, ...]]:
    return tokens(llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))


# ----- EOS --------------------------------------------------------------------------------------
def test_eos_from_config_stops_and_is_the_last_token(llm, tiny_model_dir, tmp_path):
    prompt = PROMPTS[:1]
    run = tokens(llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))[0]
    at = next(i for i in range(2, len(run)) if run[i] not in run[:i])  # the first time greedy says it
    folder = shutil.copytree(tiny_model_dir, tmp_path / "eos-model")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = run[at]
    (folder / "config.json").write_text(json.dumps(config))
    eos_llm = LLM(folder, num_gpu_blocks=16)
    assert eos_llm.engine.model_config.eos_token_ids == (run[at],)

    out = eos_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == run[: at + 1]  # like a stop token, EOS is returned as the last token

    out = eos_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length"
    assert out.token_ids == run


# ----- top-k and top-p in the engine --------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=1, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1e-6, ignore_eos=True),
], ids=["top_k=1", "top_p=1e-6"])
def test_a_filter_keeping_one_token_is_greedy(llm, greedy, params):
    assert tokens(llm.generate(PROMPTS, params)) == greedy


def test_wide_filters_sample_and_a_seed_reproduces(llm, greedy):
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=400, top_p=1.0, seed=seed,
                             ignore_eos=True) for seed in range(4)]
    prompts = [PROMPTS[0]] * len(seeded)
    first = tokens(llm.generate(prompts, seeded))
    assert tokens(llm.generate(prompts, seeded)) == first
    assert any(t != greedy[0] for t in first)
    assert len(set(first)) > 1, "different seeds should draw differently"


# ----- the filters on hand-made logits --------------------------------------------------------------
def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample_each(logits[None], [params], [gen], [()])[0].token for _ in range(n)}


def test_top_k_draws_only_the_k_most_likely_tokens():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.8, 0.0, 1.0])
    assert draws(logits, SamplingParams(temperature=1.0, top_k=2)) == {1, 3}
    assert draws(logits, SamplingParams(temperature=1.0)) == set(range(6))


def test_top_p_draws_the_smallest_set_reaching_p():
    probs = torch.tensor([0.3, 0.05, 0.15, 0.5])  # sorted: 3 (0.5), 0 (0.8), 2 (0.95), 1
    logits = probs.log()
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.7)) == {3, 0}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.9)) == {3, 0, 2}
