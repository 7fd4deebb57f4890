"""The benchmarks' pure logic: percentiles, crossovers, Poisson schedules, workloads, the main
job's sizes, the driver."""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvlayer.benchmarks.configs import ConfigFactory, TierSizes, drop_page_cache, parse_configs, redact_url
from kvlayer.benchmarks.driver import RealClock, SimClock, drive
from kvlayer.benchmarks.engine_bench import kv_blocks
from kvlayer.benchmarks.multi_round_qa import GOAL_WORKING_SET_X, engine_size
from kvlayer.benchmarks.stats import Crossover, crossover, percentile, ratio, summarize
from kvlayer.benchmarks.workloads import (
    ChatSessions,
    DocQueries,
    LongDocSpec,
    MultiRoundSpec,
    Turn,
    poisson_arrivals,
)
from kvlayer.engine.sequence import RequestTimes

# ----- stats ----------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("bad", [-1, 101])
def test_percentile_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        percentile([1.0], bad)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_gives_mean_and_tail_percentiles():
    s = summarize([float(i) for i in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in summarize([]).values())


def test_crossover_interpolates_where_loading_starts_to_win():
    # load - recompute: +0.1 at 256, -0.1 at 512 -> halfway
    c = crossover([128, 256, 512, 1024], [0.1, 0.2, 0.4, 0.8], [0.3, 0.3, 0.3, 0.3])
    assert c.kind == "between" and c.length == pytest.approx(384)
    assert c.text() == "~384"


def test_crossover_below_and_never():
    assert crossover([256, 512], [1.0, 2.0], [0.5, 0.5]) == Crossover(256.0, "below")
    assert crossover([256, 512], [1.0, 2.0], [3.0, 3.0]) == Crossover(512.0, "never")
    # noise: a loss after a win moves the crossover past the last loss
    assert crossover([1, 2, 3], [1.0, 1.0, 1.0], [0.5, 1.5, 0.5]).length == pytest.approx(2.5)


def test_crossover_rejects_unsorted_or_mismatched_input():
    with pytest.raises(ValueError):
        crossover([512, 256], [1, 1], [1, 1])
    with pytest.raises(ValueError):
        crossover([256], [1, 2], [1])


def test_ratio_is_none_for_missing_or_zero():
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


# ----- workloads ------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_ascending_and_have_the_right_rate():
    a = poisson_arrivals(4000, 2.0, seed=3)
    assert a == poisson_arrivals(4000, 2.0, seed=3)
    assert a != poisson_arrivals(4000, 2.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(0.5, rel=0.08)
    assert poisson_arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, 0)


def test_multi_round_turns_deal_round_robin_after_the_warmup():
    spec = MultiRoundSpec(users=3, rounds=3, system_tokens=8, history_tokens=4, question_tokens=2,
                          answer_tokens=1)
    warm, turns = spec.turns(rate=1.0, warmup_rounds=1)
    assert [(t.user, t.index, t.time) for t in warm] == [(0, 0, 0.0), (1, 0, 0.0), (2, 0, 0.0)]
    assert [(t.user, t.index) for t in turns] == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
    assert [t.time for t in turns] == poisson_arrivals(6, 1.0, spec.seed)
    with pytest.raises(ValueError):
        spec.turns(1.0, warmup_rounds=3)


def test_multi_round_sizes_and_prompts():
    spec = MultiRoundSpec(users=2, rounds=2, system_tokens=10, history_tokens=5, question_tokens=3,
                          answer_tokens=2)
    assert spec.max_request_tokens() == 10 + 5 + 2 * 5
    assert spec.working_set_tokens() == 10 + 2 * 15
    chat = ChatSessions(spec, vocab=100)
    p0 = chat.prompt(Turn(0, 0, 0))
    p1 = chat.prompt(Turn(0, 1, 0))
    assert p0[:10] == p1[:10] and p0[10:15] != p1[10:15]  # shared system prompt, own history
    chat.answered(Turn(0, 0, 0), p0, [5, 6])
    nxt = chat.prompt(Turn(0, 0, 1))
    assert nxt[: len(p0) + 2] == p0 + [5, 6] and len(nxt) == len(p0) + 2 + 3
    assert all(3 <= t < 100 for t in p0)


def test_long_doc_order_queries_each_document_q_times_never_twice_in_a_row():
    spec = LongDocSpec(docs=5, doc_tokens=16, queries=3, question_tokens=2, answer_tokens=1, seed=1)
    order = spec.order()
    assert sorted(order) == sorted(list(range(5)) * 3)
    assert all(a != b for a, b in zip(order, order[1:]))
    assert order == spec.order()
    q = DocQueries(spec, vocab=50)
    first = {d: order.index(d) for d in range(5)}
    assert [q.repeated(i) for i in range(len(order))] == [first[d] != i for i, d in enumerate(order)]
    assert q.prompt(Turn(0, 0, 0))[:16] == spec.document(order[0], 50)


# ----- the main job -------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _main_job_argv() -> list[str]:
    """The ``kvlayer bench multi-round-qa ...`` words of scripts/main.sh (the README's main
    command), ``"$@"`` left out."""
    script = (ROOT / "scripts" / "main.sh").read_text().replace("\\\n", " ")
    (line,) = [line for line in script.splitlines()
               if "bench multi-round-qa" in line and not line.lstrip().startswith("#")]
    words = shlex.split(line)
    return [w for w in words[words.index("bench"):] if w != "$@"]


def test_the_main_job_runs_a_working_set_at_least_4x_the_engine_kv():
    """No model run: the main job's flags and the benchmark's own defaults give a working set of
    at least ``GOAL_WORKING_SET_X`` (4) times the engine KV capacity it configures, and compare
    the two configurations the goal is about."""
    from kvlayer.cli import build_parser

    assert "scripts/main.sh" in (ROOT / "README.md").read_text()
    argv = _main_job_argv()
    assert argv[:2] == ["bench", "multi-round-qa"]
    args = build_parser().parse_args(argv)
    spec = MultiRoundSpec(args.users, args.rounds, args.system_tokens, args.history_tokens, args.question_tokens,
                          args.answer_tokens, args.seed)
    size = engine_size(spec, args.engine_kv_tokens)
    assert size.tokens >= spec.max_request_tokens()
    assert spec.working_set_tokens() / size.tokens >= GOAL_WORKING_SET_X
    assert {"engine", "cpu+nvme"} <= set(parse_configs(args.configs))


def test_engine_bench_kv_cache_holds_its_largest_case():
    # by hand: 8192 + 1 tokens need 513 blocks of 16, +1 spare; 16 x (160 tokens: 10 blocks + 1) = 176
    assert kv_blocks([512, 2048, 8192], 16, 128, 32) == 514
    # the decode case is the larger: 2 x (20 tokens: 2 blocks + 1) = 6 against 64 + 1 tokens: 5 + 1
    assert kv_blocks([32], 2, 16, 4) == 6
    assert kv_blocks([1], 1, 1, 1) == 6  # the 64-token warm-up


# ----- configurations ---------------------------------------------------------------------


def test_parse_configs_keeps_order_and_rejects_unknown_names():
    assert parse_configs("engine, cpu+nvme,engine") == ["engine", "cpu+nvme"]
    with pytest.raises(ValueError, match="disk"):
        parse_configs("cpu,disk")


def test_config_factory_builds_fresh_isolated_kvlayer_configs(tmp_path):
    with ConfigFactory(TierSizes(chunk_size=64, cpu_capacity=1024), str(tmp_path), None, False, True) as f:
        assert f.available(["cpu", "redis"]) == ["cpu"]
        a, b = f.build("cpu+nvme"), f.build("cpu+nvme", layerwise=False, label="x")
        assert a.nvme_path != b.nvme_path and a.nvme_path.startswith(f.root)
        assert a.kv_config["chunk_size"] == 64 and b.kv_config["layerwise"] is False and b.label == "x"
        assert a.prefix_caching and a.has_cpu_tier and not f.build("nvme").has_cpu_tier
        assert f.build("recompute").kv_config is None and not f.build("recompute").prefix_caching
        with pytest.raises(ValueError, match="redis"):
            f.build("redis")
    assert not os.path.exists(f.root)


def test_redact_url_masks_only_the_password():
    assert redact_url("redis://user:s3cret@host:6380/0") == "redis://user:***@host:6380/0"
    assert redact_url("rediss://:s3cret@host") == "rediss://:***@host"
    assert redact_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"


def test_drop_page_cache_visits_every_file(tmp_path):
    (tmp_path / "a").mkdir()
    for name in ("a/1", "a/2", "3"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    assert drop_page_cache(str(tmp_path)) == 3
    assert drop_page_cache(None) == 0


# ----- driver -------------------------------------------------------------------------------


@dataclass
class _Out:
    request_id: str
    finished: bool
    outputs: tuple
    num_cached_tokens: int = 0
    num_external_tokens: int = 0
    metrics: object = None


class _FakeEngine:
    """One token per live request per step; the first step of a request takes ``prefill`` steps."""

    def __init__(self, prefill: int = 2) -> None:
        self.live: dict[str, list] = {}
        self.prefill = prefill
        self.n = 0

    def add_request(self, prompt, params):
        self.n += 1
        self.live[str(self.n)] = [self.prefill, [], params]
        return str(self.n)

    def step(self):
        outs = []
        for rid, st in list(self.live.items()):
            if st[0] > 1:
                st[0] -= 1
                continue
            st[1].append(7)
            done = len(st[1]) == st[2]
            times = RequestTimes(0.0, first_scheduled_time=1.0, first_token_time=1.5)
            outs.append(_Out(rid, done, (type("C", (), {"token_ids": tuple(st[1])}),), metrics=times))
            if done:
                del self.live[rid]
        return outs


class _StepClock(SimClock):
    """Every step lasts exactly one second."""

    def advance(self, seconds: float) -> None:
        super().advance(1.0)


def test_drive_keeps_one_request_per_user_and_times_from_submission():
    spec = MultiRoundSpec(users=2, rounds=2, system_tokens=4, history_tokens=4, question_tokens=2,
                          answer_tokens=3)
    turns = [Turn(0.0, 0, 0), Turn(0.5, 1, 0), Turn(1.0, 0, 1), Turn(50.0, 1, 1)]
    done = []
    recs = drive(_FakeEngine(), turns, ChatSessions(spec, 50), 3, _StepClock(), advance=done.append)
    assert len(recs) == 4 and done == [1] * 4
    by = {(r.turn.user, r.turn.index): r for r in recs}
    # user 0's second turn was due at 1.0 but waited for the first answer (prefill 2 + 3 tokens)
    assert by[(0, 1)].submit_time == by[(0, 0)].finish_time == 4.0
    assert by[(0, 0)].ttft == 2.0 and by[(0, 0)].num_output == 3
    assert by[(0, 0)].unqueued_ttft == 0.5  # from the engine's own timestamps
    assert by[(1, 1)].submit_time == 50.0  # idle: the clock jumped to the arrival
    assert by[(1, 0)].submit_time == 1.0  # submitted at the first step boundary after 0.5


def test_real_clock_sleeps_until_an_arrival():
    clock = RealClock()
    clock.wait_until(0.05)
    assert clock.now() >= 0.05


def test_ttft_prompts_share_exactly_what_each_case_reuses() -> None:
    from kvlayer.benchmarks.ttft_measure import make_prompts, median_of

    p = make_prompts(64, 8, 1000)
    assert len(p.full) == len(p.partial()) == len(p.sibling()) == 72
    assert p.sibling()[:64] == p.full[:64] and p.sibling()[64:] != p.full[64:]
    assert p.partial()[:32] == p.full[:32] and p.partial()[32:] != p.full[32:]
    assert p.partial(1)[:32] == p.full[:32] and p.partial(1)[32:] != p.partial(0)[32:], "each variant new"
    assert p.sibling(1)[64:] != p.sibling(0)[64:]
    assert make_prompts(64, 8, 1000).partial() == p.partial(), "the same prompts in every run"
    assert median_of(3, lambda k: [3.0, 1.0, 2.0][k]) == 2.0
    assert median_of(2, lambda k: None if k else 1.0) is None
