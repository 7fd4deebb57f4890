"""The scheduler seen through ``add_request``/``step``: batch limits, first come first served, token
budgets and request timings, on the tiny random model (CPU, float32).

Run: ``.venv/bin/python -m pytest tests/engine/test_scheduling.py``.
"""

from __future__ import annotations

import time

import pytest

from kvlayer.engine import LLM, SamplingParams
from kvlayer.engine.llm import LLMEngine
from kvlayer.engine.scheduler import StepPlan


def record_plans(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[StepPlan]:
    """Every plan the engine's scheduler makes from now on, in order."""
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule

    def recording() -> StepPlan:
        plans.append(schedule())
        return plans[-1]

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return plans


def first_token_steps(engine: LLMEngine) -> dict[str, int]:
    """Steps until every request is done; the index of the step giving each request its first token."""
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, step)
        step += 1
    return first


def test_max_num_seqs_and_first_come_first_served(tiny_model_dir, monkeypatch):
    engine = LLM(tiny_model_dir, num_gpu_blocks=64, max_num_seqs=2).engine
    plans = record_plans(engine, monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(5):
        engine.add_request({"prompt_token_ids": [20 + i] * 12}, params, request_id=f"r{i}")
    first = first_token_steps(engine)
    assert max(len(p.all) for p in plans) == 2
    # two at a time, in arrival order: each pair runs its 3 tokens before the next is admitted
    assert first == {"r0": 0, "r1": 0, "r2": 3, "r3": 3, "r4": 6}
    assert [sorted(s.seq.request_id for s in p.all) for p in plans[::3]] == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_max_num_batched_tokens_chunks_prefills(tiny_model_dir, monkeypatch):
    engine = LLM(tiny_model_dir, num_gpu_blocks=64, max_num_batched_tokens=24).engine
    plans = record_plans(engine, monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request({"prompt_token_ids": list(range(100, 140))}, params, request_id="a")
    engine.add_request({"prompt_token_ids": list(range(200, 240))}, params, request_id="b")
    first = first_token_steps(engine)
    pieces = [[(s.seq.request_id, s.num_new) for s in p.all] for p in plans]
    assert pieces == [
        [("a", 24)],
        [("a", 16), ("b", 8)],  # a's prefill ends; b starts in the budget left
        [("a", 1), ("b", 23)],  # running sequences first: a's decode, then b's next chunk
        [("a", 1), ("b", 9)],
        [("b", 1)],
        [("b", 1)],
    ]
    assert first == {"a": 1, "b": 3}


def test_arrival_time_is_kept_and_later_times_follow_it(tiny_model_dir):
    engine = LLM(tiny_model_dir, num_gpu_blocks=16).engine
    arrival = time.perf_counter() - 5.0
    engine.add_request({"prompt_token_ids": list(range(30, 50))},
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), arrival_time=arrival)
    windows, outs = [], []
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outs += engine.step()
        windows.append((before, time.perf_counter()))
    assert len(windows) == len(outs) == 3
    m = outs[-1].metrics
    assert m.arrival_time == arrival
    assert windows[0][0] <= m.first_scheduled_time <= m.first_token_time <= windows[0][1]
    assert windows[-1][0] <= m.finish_time <= windows[-1][1]
    assert m.ttft == m.first_token_time - arrival
    assert m.ttft >= 5.0
