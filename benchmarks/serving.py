"""Serving runs shared by ``multi-round-qa`` and ``long-doc-qa``: one configuration, one engine,
a list of turns; the result is plain data (TTFT percentiles, throughput, hit rate per tier).

Hit rates are fractions of all prompt tokens: ``engine`` (the engine's own prefix cache),
``kvlayer`` (loaded through the connector) split over kvlayer's tiers in proportion to the
tokens each tier served (its ``hit_tokens`` counter), and ``recomputed`` (the rest).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlayer.benchmarks.configs import BenchConfig, make_llm, tier_hit_tokens
from kvlayer.benchmarks.driver import CLOCKS, RequestRecord, Sessions, drive
from kvlayer.benchmarks.stats import summarize
from kvlayer.benchmarks.workloads import Turn

WARMUP_TOKENS = 64


@dataclass(frozen=True, slots=True)
class EngineSize:
    """The engine's KV capacity (``num_gpu_blocks`` blocks of 16 tokens) and step budget."""

    num_gpu_blocks: int
    max_num_batched_tokens: int = 4096

    @property
    def tokens(self) -> int:
        return self.num_gpu_blocks * 16


def serve(model: str, device: str, config: BenchConfig, size: EngineSize, warmup: list[Turn], turns: list[Turn],
          make_sessions: Callable[[int], Sessions], answer_tokens: int, clock: str,
          advance: Callable[[int], None]) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Serve ``warmup`` then ``turns`` under ``config``; returns (summary of ``turns``, their
    records). The summary's ``warmup`` holds the warm-up turns' own summary.

    ``make_sessions(vocab)`` builds the workload's sessions (kept across both phases); every
    request generates exactly ``answer_tokens`` tokens greedily. The engine first serves one
    short request to warm up; each phase runs on a fresh clock.
    """
    from kvlayer.engine import SamplingParams

    llm = make_llm(model, device, config, num_gpu_blocks=size.num_gpu_blocks,
                   max_num_batched_tokens=size.max_num_batched_tokens)
    try:
        vocab = llm.engine.model_config.vocab_size
        warm = [random.Random(-1).randrange(3, vocab) for _ in range(WARMUP_TOKENS)]
        llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=2, temperature=0))
        params = SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True)
        sessions = make_sessions(vocab)
        phases = []
        for phase in (warmup, turns):
            before = tier_hit_tokens(llm.kv_stats())
            preempted = llm.engine.scheduler.num_preemptions
            records = drive(llm.engine, phase, sessions, params, CLOCKS[clock](), advance) if phase else []
            after = tier_hit_tokens(llm.kv_stats())
            summary = summarize_run(config, records, {t: after[t] - before.get(t, 0) for t in after})
            summary["preemptions"] = llm.engine.scheduler.num_preemptions - preempted
            phases.append(summary)
        phases[1]["warmup"] = phases[0]
        return phases[1], records
    finally:
        llm.close()


def summarize_run(config: BenchConfig, records: list[RequestRecord], tier_tokens: dict[str, int]) -> dict[str, Any]:
    """The plain-data result of one configuration's run (see the module docstring); {} for no records."""
    if not records:
        return {}
    prompt = sum(r.num_prompt for r in records)
    cached = sum(r.num_cached for r in records)
    external = sum(r.num_external for r in records)
    span = max(r.finish_time or 0.0 for r in records) - min(r.submit_time for r in records)
    served = sum(tier_tokens.values())
    hit = {"engine": cached / prompt, "kvlayer": external / prompt}
    for tier, n in tier_tokens.items():
        hit[tier] = external / prompt * n / served if served else 0.0
    return {
        "config": config.label, "kvlayer": config.public_kv_config(),
        "prefix_caching": config.prefix_caching, "requests": len(records), "span_s": span,
        "ttft_s": summarize([r.ttft for r in records]),
        "unqueued_ttft_s": summarize([r.unqueued_ttft for r in records if r.unqueued_ttft is not None]),
        "request_per_s": len(records) / span if span > 0 else None,
        "generated_tok_per_s": sum(r.num_output for r in records) / span if span > 0 else None,
        "prompt_tokens": prompt, "hit_rate": hit, "recomputed": 1 - (cached + external) / prompt,
        "tier_hit_tokens": tier_tokens,
    }


def request_rows(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Per request, in submission order: user, turn, submit time, TTFT, tokens and their source."""
    return [{"user": r.turn.user, "turn": r.turn.index, "submit_s": r.submit_time, "ttft_s": r.ttft,
             "unqueued_ttft_s": r.unqueued_ttft,
             "prompt": r.num_prompt, "cached": r.num_cached, "external": r.num_external, "output": r.num_output}
            for r in sorted(records, key=lambda r: r.submit_time)]


TIER_ORDER = ("engine", "gpu", "cpu", "nvme", "redis")


def hit_columns(results: list[dict[str, Any]]) -> list[str]:
    """The hit-rate keys present in any result, engine first, then kvlayer's tiers top down."""
    present = {k for r in results for k in r["hit_rate"] if k != "kvlayer"}
    return [k for k in TIER_ORDER if k in present] + sorted(present - set(TIER_ORDER))


def plot_sources(ax: Any, results: list[dict[str, Any]]) -> None:
    """Stacked bars per configuration: the share of prompt tokens each source served."""
    names = [r["config"] for r in results]
    x = list(range(len(names)))
    bottom = [0.0] * len(results)
    for source in [*hit_columns(results), "recomputed"]:
        vals = [r["recomputed"] if source == "recomputed" else r["hit_rate"].get(source, 0.0) for r in results]
        ax.bar(x, vals, bottom=bottom, label=source)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x, names, rotation=20)
    ax.set(ylabel="share of prompt tokens", title="where prompt tokens came from", ylim=(0, 1))
    ax.legend(fontsize=8)
