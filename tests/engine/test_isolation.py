"""Step isolation: one request's bad sampling values are refused up front, and one request's failure
in a step (its logits processor raises or returns NaN, its draw fails, the model gives it NaN
logits) finishes that request alone with reason "error"; the others' tokens are exactly those of a
run without it.

Run: ``.venv/bin/python -m pytest tests/engine/test_isolation.py``. The tiny random model on the CPU
in float32; the model fault is real: a copy of the model whose embedding of one token is NaN.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvlayer.engine import LLM, SamplingParams
from kvlayer.engine.sampling import SEED_MAX, SEED_MIN, InvalidSamplingParam
from tests.nan_model import NAN_TOKEN, nan_embedding_model

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, seed=11, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    """``n`` random token ids, never ``NAN_TOKEN``."""
    rng = random.Random(seed)
    return [rng.randrange(NAN_TOKEN + 1, 500) for _ in range(n)]


GOOD = [ids(20, 1), ids(33, 2), ids(12, 3), ids(47, 4)]
GOOD_PARAMS = [GREEDY, GREEDY, GREEDY, SEEDED]
BAD_PROMPT = ids(26, 5)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks=64)


def run(llm: LLM, bad: SamplingParams | None, arrive_at: int = 2) -> tuple[list, object, bool]:
    """The four good requests, decoding when ``bad`` (if any) arrives at step ``arrive_at``: their
    final outputs, the bad one's, and whether the bad one shared a step with all four."""
    engine = llm.engine
    llm.reset_prefix_cache()
    good = [engine.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(GOOD, GOOD_PARAMS, strict=True)]
    bad_id = None
    final, shared, step = {}, False, 0
    while engine.has_unfinished_requests() or (bad is not None and bad_id is None):
        if step == arrive_at and bad is not None:
            bad_id = engine.add_request({"prompt_token_ids": BAD_PROMPT}, bad)
        outs = engine.step()
        seen = {o.request_id for o in outs}
        shared |= bad_id in seen and seen.issuperset(good)
        final.update((o.request_id, o) for o in outs if o.finished)
        step += 1
    assert engine.block_manager.num_used_blocks == 0
    return [final[r] for r in good], final.get(bad_id), shared


def tokens(outs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def without_bad(llm) -> list[tuple[int, ...]]:
    outs, _, _ = run(llm, None)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return tokens(outs)


@pytest.fixture(scope="module")
def bad_alone(llm) -> tuple[int, ...]:
    return llm.generate([{"prompt_token_ids": BAD_PROMPT}], GREEDY)[0].outputs[0].token_ids


# ----- faults injected through the bad request's own logits processor --------------------------------
def after_calls(n: int, action):
    """A processor that passes logits through ``n`` times, then does ``action(logits)``."""
    calls = []

    def processor(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        calls.append(len(output_ids))
        return logits if len(calls) <= n else action(logits)
    return processor


def _raise(logits: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("injected\nfault")


def _huge(logits: torch.Tensor) -> torch.Tensor:  # finite, but overflows once divided by the temperature
    out = torch.full_like(logits, -3e38)
    out[0] = 3e38
    return out


FAULTS = {  # a fresh processor, the temperature, the tokens before the failure, the error's start
    "raises": (lambda: after_calls(2, _raise), 0.0, 2, "a logits processor raised RuntimeError: injected fault"),
    "nan": (lambda: after_calls(1, lambda x: torch.full_like(x, math.nan)), 0.0, 1,
            "the logits processors left NaN or infinity in the logits"),
    "all_masked": (lambda: after_calls(0, lambda x: torch.full_like(x, -math.inf)), 0.0, 0,
                   "the logits processors left NaN or infinity"),
    "wrong_shape": (lambda: after_calls(3, lambda x: x[:10]), 0.0, 3,
                    "a logits processor returned (10,), not a tensor"),
    "draw_fails": (lambda: after_calls(0, _huge), 1e-5, 0, "sampling failed: RuntimeError"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_request_finishes_alone_with_error(llm, without_bad, bad_alone, fault):
    make, temperature, good_tokens, message = FAULTS[fault]
    bad = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, ignore_eos=True, logits_processors=(make(),))
    outs, failed, shared = run(llm, bad)
    assert shared, "the bad request never shared a step with the others"
    assert tokens(outs) == without_bad
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].error is None for o in outs)
    comp = failed.outputs[0]
    assert failed.finished and comp.finish_reason == "error"
    assert comp.error.startswith(message) and "\n" not in comp.error, comp.error
    assert len(comp.token_ids) == good_tokens
    if temperature == 0.0:
        assert comp.token_ids == bad_alone[:good_tokens], "the tokens before the failure are kept"


def test_a_processor_that_passes_logits_through_changes_nothing(llm, without_bad, bad_alone):
    outs, ok, _ = run(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                          logits_processors=(after_calls(10**6, _raise),)))
    assert tokens(outs) == without_bad
    assert ok.outputs[0].finish_reason == "length" and ok.outputs[0].token_ids == bad_alone


def test_a_processor_sees_its_requests_output_so_far_and_steers_it(llm):
    seen: list[list[int]] = []

    def only_42(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_ids))
        return torch.full_like(logits, -math.inf).index_fill_(0, torch.tensor([42]), 0.0)
    out = llm.generate([{"prompt_token_ids": GOOD[0]}],
                       SamplingParams(max_tokens=3, ignore_eos=True, logits_processors=(only_42,)))[0]
    assert out.outputs[0].token_ids == (42, 42, 42)
    assert seen == [[], [42], [42, 42]]


def test_a_processor_may_edit_its_logits_in_place(llm):
    """vLLM's usual form (``logits[banned] = -inf; return logits``): the model's logits come out
    of inference mode, so the processor must get a row it may write."""
    plain = llm.generate([{"prompt_token_ids": GOOD[0]}], GREEDY)[0].outputs[0].token_ids
    first = plain[0]

    def ban_first(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[first] = -math.inf
        return logits
    out = llm.generate([{"prompt_token_ids": GOOD[0]}], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logits_processors=(ban_first,)))[0].outputs[0]
    assert out.finish_reason == "length" and out.error is None
    assert first not in out.token_ids and out.token_ids != plain, "the greedy choice was banned"


# ----- a real model fault: NaN from the model for one request -----------------------------------------
def test_nan_from_the_model_fails_that_request_alone_and_never_reaches_another(tiny_model_dir, tmp_path):
    """The NaN request holds block 0 while the others decode (their block tables are padded, and
    the padding once read block 0), and its blocks go back to them as they grow (a masked stale
    NaN slot would poison them): neither may change their tokens."""
    folder = nan_embedding_model(tiny_model_dir, tmp_path / "nan-model")
    goods = [ids(10, 11), ids(40, 12), ids(25, 13)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(folder, num_gpu_blocks=64) as ref:
        want = tokens(ref.generate([{"prompt_token_ids": p} for p in goods], params))
    llm = LLM(folder, num_gpu_blocks=16)  # closed with the test (no connector to close)
    engine, bm = llm.engine, llm.engine.block_manager
    llm.generate([{"prompt_token_ids": ids(20, 14)}], SamplingParams(max_tokens=1))  # blocks 0, 1 go last
    good = [engine.add_request({"prompt_token_ids": p}, params) for p in goods]
    final = {o.request_id: o for _ in range(2) for o in engine.step()}
    poisoned = [NAN_TOKEN, *ids(149, 15)]
    assert bm.blocks_needed(len(poisoned) + 1) == bm.num_free_blocks and list(bm.free)[-1] == 0, \
        "the scenario needs the NaN request to take every free block, block 0 last"
    bad = engine.add_request({"prompt_token_ids": poisoned}, params)
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step())
    comp = final[bad].outputs[0]
    assert comp.finish_reason == "error" and comp.error == "the model's logits hold NaN or infinity"
    assert comp.token_ids == ()
    assert tokens(final[r] for r in good) == want
    assert bm.num_used_blocks == 0
    again = [engine.add_request({"prompt_token_ids": p}, params) for p in goods]  # on the scrubbed blocks
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step())
    assert tokens(final[r] for r in again) == want


# ----- bad values are refused when the request is built ---------------------------------------------
REFUSED = [
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, "temperature", "temperature must be a finite number, got inf"),
    ({"temperature": 1e308}, "temperature", "temperature must be <= 100, got 1e+308"),
    ({"temperature": -0.5}, "temperature", "temperature must be >= 0, got -0.5"),
    ({"temperature": "1"}, "temperature", "temperature must be a number, got str"),
    ({"top_p": math.nan}, "top_p", "top_p must be a finite number, got nan"),
    ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -1}, "top_k", "top_k must be >= 0, got -1"),
    ({"top_k": 2.0}, "top_k", "top_k must be an integer, got float"),
    ({"min_p": math.nan}, "min_p", "min_p must be a finite number"),
    ({"min_p": 1.5}, "min_p", "min_p must be <= 1, got 1.5"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"seed": SEED_MAX + 1}, "seed", f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {SEED_MAX + 1}"),
    ({"seed": SEED_MIN - 1}, "seed", "seed must be in ["),
    ({"seed": 10**400}, "seed", "got an integer of 1329 bits"),
    ({"seed": True}, "seed", "seed must be an integer, got bool"),
    ({"stop_token_ids": (3, -1)}, "stop_token_ids", "stop_token_ids must be >= 0, got -1"),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be a bool"),
    ({"logits_processors": (1,)}, "logits_processors", "logits_processors must be callables"),
]


@pytest.mark.parametrize(("change", "field", "message"), REFUSED,
                         ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(REFUSED)])
def test_bad_values_are_refused_naming_the_field(change, field, message):
    with pytest.raises(InvalidSamplingParam) as info:
        SamplingParams(**change)
    assert info.value.field == field and message in str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_a_stop_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(InvalidSamplingParam, match=r"stop token id 512 is outside the vocabulary \[0, 512\)") as info:
        llm.engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(stop_token_ids=(3, 512)))
    assert info.value.field == "stop_token_ids" and not llm.engine.has_unfinished_requests()


def test_a_temperature_below_1e_5_is_greedy(llm, without_bad):
    prompts = [{"prompt_token_ids": p} for p in GOOD[:3]]
    for t in (1e-40, 5e-324, 9e-6):
        got = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=t, ignore_eos=True))
        assert tokens(got) == without_bad[:3]


def test_min_p_of_one_keeps_only_the_most_likely_token(llm, without_bad):
    got = llm.generate([{"prompt_token_ids": GOOD[0]}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True))
    assert tokens(got) == without_bad[:1]


def test_the_extreme_seeds_are_taken_and_reproduce(llm):
    prompt = [{"prompt_token_ids": GOOD[0]}]
    for seed in (SEED_MIN, SEED_MAX):
        p = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        assert tokens(llm.generate(prompt, p)) == tokens(llm.generate(prompt, p))
