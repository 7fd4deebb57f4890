"""Greedy generation through the whole engine equals transformers' ``generate`` token for token."""

from __future__ import annotations

import random

import pytest
import torch

from kvlayer.engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("length", [5, 37, 64])
def test_greedy_32_tokens_match_transformers(tiny_model_dir, length):
    ids = [random.Random(length).randrange(3, 500) for _ in range(length)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, length, dtype=torch.long), pad_token_id=0)
    expected = tuple(ref[0, length:].tolist())
    llm = LLM(tiny_model_dir, num_gpu_blocks=64)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
