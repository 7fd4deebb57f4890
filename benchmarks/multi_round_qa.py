"""``kvlayer bench multi-round-qa``: chat users taking turns, with more context than the engine holds.

``--users`` users share a system prompt and each brings a history of their own; they ask
``--rounds`` questions, arriving as a Poisson process of ``--rate`` requests/s dealt round
robin (a user waits for their previous answer; TTFT counts from submission), served through
the engine's ``add_request``/``step`` on a simulated clock (``--clock sim``: measured step
times, idle gaps skipped) or in real time (``--clock real``). Every user's first
``--warmup-rounds`` questions are served before measuring, so every user has a history by
then (the steady state of returning users); the table reports the other turns.

The engine's KV capacity is kept small on purpose (``--engine-kv-tokens``, default just the
largest request), so the working set exceeds it several times over and the engine's own
prefix cache keeps only the hot system prompt; kvlayer's tiers sit below it (engine prefix
cache still on) and serve the users' histories. The CPU tier defaults to half the working
set, so NVMe serves as well. Goal (``cpu+nvme`` against ``engine``, working set >= 4x the
engine's KV): mean TTFT >= 10x lower and generated tokens/s >= 3x higher; the ratios are printed.

With ``--endpoint URL`` the same users and arrivals go to an OpenAI-compatible server instead
(``kvlayer serve``, ``vllm serve`` ...) as concurrent HTTP clients on the wall clock; the
in-process flags (``--configs``, ``--clock``, ``--engine-kv-tokens``, the tier capacities,
``--layerwise``, ``--device``) are refused then: one run per server, named by ``--label``
(benchmarks/http_bench.py).

Example: ``kvlayer bench multi-round-qa --configs engine,cpu+nvme --plot mrqa.png``;
over HTTP: ``kvlayer bench multi-round-qa --endpoint http://127.0.0.1:8000 --vocab 32000 --label ours``
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlayer.benchmarks.common import (
    add_plot_argument,
    close_figure,
    default_model,
    machine_info,
    model_facts,
    new_figure,
    nonnegative_int,
    positive_float,
    positive_int,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.configs import add_config_arguments, factory_from_args, parse_configs
from kvlayer.benchmarks.driver import CLOCKS
from kvlayer.benchmarks.http_bench import HttpWorkload, add_http_arguments, http_mode, run_http
from kvlayer.benchmarks.serving import EngineSize, hit_columns, plot_sources, request_rows, serve
from kvlayer.benchmarks.stats import ratio
from kvlayer.benchmarks.workloads import ChatSessions, MultiRoundSpec

GOAL_TTFT_X, GOAL_TOKS_X, GOAL_WORKING_SET_X = 10.0, 3.0, 4.0
IN_PROCESS = ("configs", "chunk_size", "cpu_capacity", "nvme_capacity", "cache_dir", "redis_url", "layerwise",
              "clock", "engine_kv_tokens", "device")
"""The flags of the in-process mode only (refused with ``--endpoint``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--users", type=positive_int, default=8)
    p.add_argument("--rounds", type=positive_int, default=4, help="questions per user, warm-up rounds included")
    p.add_argument("--warmup-rounds", type=nonnegative_int, default=1,
                   help="first questions of every user served before measuring (they bring the history in); "
                        "fewer than --rounds")
    p.add_argument("--system-tokens", type=nonnegative_int, default=512, help="shared system prompt")
    p.add_argument("--history-tokens", type=nonnegative_int, default=3072,
                   help="each user's own history before round 1")
    p.add_argument("--question-tokens", type=positive_int, default=32)
    p.add_argument("--answer-tokens", type=positive_int, default=8)
    p.add_argument("--rate", type=positive_float, default=1.0, help="request arrivals per second (Poisson)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="sim",
                   help="sim: simulated clock from measured step times; real: wall time")
    p.add_argument("--engine-kv-tokens", type=nonnegative_int, default=0,
                   help="engine KV capacity in tokens (default: just the largest request)")
    p.add_argument("--layerwise", choices=("auto", "on", "off"), default="on",
                   help="kvlayer's layer-by-layer loading (the config key layerwise)")
    p.add_argument("--seed", type=int, default=0)
    add_config_arguments(p, "recompute,engine,cpu,cpu+nvme,nvme,redis", cpu_capacity="auto")
    add_plot_argument(p)
    add_http_arguments(p, IN_PROCESS)


def engine_size(spec: MultiRoundSpec, kv_tokens: int) -> EngineSize:
    """Blocks for ``kv_tokens`` (0: the largest request plus one block), never fewer than the
    largest request needs."""
    need = -(-spec.max_request_tokens() // 16)
    return EngineSize(max(need, -(-kv_tokens // 16) if kv_tokens else need + 1))


def main(args: argparse.Namespace) -> int:
    if args.warmup_rounds >= args.rounds:
        raise ValueError(f"--warmup-rounds must be below --rounds ({args.rounds}), got {args.warmup_rounds}")
    spec = MultiRoundSpec(args.users, args.rounds, args.system_tokens, args.history_tokens,
                          args.question_tokens, args.answer_tokens, args.seed)
    if http_mode(args):
        return run_http(args, http_workload(spec, args.rate, args.warmup_rounds), IN_PROCESS)
    names = parse_configs(args.configs)
    size = engine_size(spec, args.engine_kv_tokens)
    warmup, turns = spec.turns(args.rate, args.warmup_rounds)
    model = args.model or default_model(args.home, "bench")
    results, records = [], {}
    # auto: half the working set's KV, so the CPU tier cannot hold every user and NVMe serves too
    half = spec.working_set_tokens() * model_facts(model, args.device)["kv_bytes_per_token"] // 2
    cpu = half if args.cpu_capacity == "auto" else None
    with factory_from_args(args, names, kvlayer_prefix_caching=True, cpu_capacity=cpu) as factory:
        names = factory.available(names)
        print(f"multi-round-qa: {spec.users} users x {spec.rounds} rounds at {args.rate:g} req/s "
              f"({args.clock} clock); working set {spec.working_set_tokens():,} tokens = "
              f"{spec.working_set_tokens() / size.tokens:.1f} x the engine's KV capacity of {size.tokens:,} tokens")
        print(f"measured: {len(turns)} turns after {len(warmup)} warm-up turns (every user's first "
              f"{args.warmup_rounds}), each user's history stored by then")
        with progress(len(names) * (len(warmup) + len(turns)), "multi-round-qa") as advance:
            for name in names:
                config = factory.build(name, layerwise=args.layerwise)
                summary, recs = serve(model, args.device, config, size, warmup, turns,
                                            lambda vocab: ChatSessions(spec, vocab), spec.answer_tokens,
                                            args.clock, advance)
                results.append(summary)
                records[name] = request_rows(recs)
    record = {"bench": "multi-round-qa", "machine": machine_info(args.device), "model": model_facts(model, args.device),
              "settings": settings_of(args), "clock": args.clock,
              "working_set_tokens": spec.working_set_tokens(), "engine_kv_tokens": size.tokens,
              "working_set_over_engine_kv": spec.working_set_tokens() / size.tokens,
              "cpu_capacity": factory.sizes.cpu_capacity, "results": results, "requests": records}
    record["goals"] = report(results, record)
    write_json(args.json, record)
    plot(args.plot, results, records, record)
    return 0


def http_workload(spec: MultiRoundSpec, rate: float, warmup_rounds: int) -> HttpWorkload:
    """The users and arrivals of ``main``'s in-process run, for the HTTP mode."""
    warmup, turns = spec.turns(rate, warmup_rounds)
    setup = (f"{spec.users} users x {spec.rounds} rounds ({warmup_rounds} warm-up) at {rate:g} req/s Poisson, "
             f"system {spec.system_tokens} + history {spec.history_tokens} tokens, questions "
             f"{spec.question_tokens}, answers {spec.answer_tokens}")
    return HttpWorkload("multi-round-qa", spec.users, spec.answer_tokens,
                        lambda vocab: (ChatSessions(spec, vocab), warmup, turns), setup)


def report(results: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any]:
    """Print the comparison table and the goal ratios (``cpu+nvme`` against ``engine``); returns them."""
    tiers = hit_columns(results)
    cols = ["config", "TTFT mean s", "p50", "p90", "p99", "unqueued s", "req/s", "gen tok/s",
            *[f"hit {t}" for t in tiers], "recomputed", "preempt"]
    rows = [[r["config"], r["ttft_s"]["mean"], r["ttft_s"]["p50"], r["ttft_s"]["p90"], r["ttft_s"]["p99"],
             r["unqueued_ttft_s"]["mean"],
             r["request_per_s"], r["generated_tok_per_s"], *[r["hit_rate"].get(t) for t in tiers],
             r["recomputed"], r["preemptions"]] for r in results]
    m = record["model"]
    print_table(f"multi-round-qa: {m.get('name')} ({record['clock']} clock), working set "
                f"{record['working_set_over_engine_kv']:.1f} x engine KV", cols, rows)
    by = {r["config"]: r for r in results}
    goals: dict[str, Any] = {"working_set_over_engine_kv": record["working_set_over_engine_kv"]}
    base = by.get("engine")
    for name, r in by.items():
        if base is None or r["kvlayer"] is None:
            continue
        ttft_x = ratio(base["ttft_s"]["mean"], r["ttft_s"]["mean"])
        toks_x = ratio(r["generated_tok_per_s"], base["generated_tok_per_s"])
        unqueued_x = ratio(base["unqueued_ttft_s"]["mean"], r["unqueued_ttft_s"]["mean"])
        goals[name] = {"mean_ttft_x_lower": ttft_x, "gen_tok_s_x_higher": toks_x, "unqueued_ttft_x_lower": unqueued_x}
        line = (f"{name} vs engine: mean TTFT engine/{name} = {ttft_x:.1f}x ({unqueued_x:.1f}x without queueing), "
                f"generated tokens/s {name}/engine = {toks_x:.1f}x")
        if name == "cpu+nvme":
            met = (ttft_x >= GOAL_TTFT_X and toks_x >= GOAL_TOKS_X
                   and record["working_set_over_engine_kv"] >= GOAL_WORKING_SET_X)
            goals[name]["goal_met"] = met
            line += (f"  (goal: >= {GOAL_TTFT_X:g}x and >= {GOAL_TOKS_X:g}x with working set >= "
                     f"{GOAL_WORKING_SET_X:g}x engine KV: {'met' if met else 'MISSED'})")
        print(line)
    return goals


def plot(path: str | None, results: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]],
         record: dict[str, Any]) -> None:
    if not path:
        return
    fig, axes = new_figure(1, 3, (15, 4.8))
    ax_t, ax_bar, ax_hit = axes[0]
    for name, rows in records.items():
        ax_t.plot([r["submit_s"] for r in rows], [r["ttft_s"] for r in rows], marker=".", label=name)
    ax_t.set(xlabel=f"submitted at ({record['clock']} clock) s", ylabel="TTFT s", yscale="log",
             title="TTFT per request")
    ax_t.legend(fontsize=8)
    names = [r["config"] for r in results]
    x = range(len(names))
    ax_bar.bar([i - 0.2 for i in x], [r["ttft_s"]["mean"] for r in results], 0.4, label="mean TTFT s")
    ax_tok = ax_bar.twinx()
    ax_tok.bar([i + 0.2 for i in x], [r["generated_tok_per_s"] for r in results], 0.4, color="tab:green",
               label="generated tok/s")
    ax_bar.set_xticks(list(x), names, rotation=20)
    ax_bar.set(ylabel="mean TTFT s", title="TTFT (blue) and generated tokens/s (green)")
    ax_tok.set_ylabel("generated tok/s")
    plot_sources(ax_hit, results)
    fig.suptitle(f"multi-round-qa: working set {record['working_set_over_engine_kv']:.1f} x engine KV capacity")
    st = record["settings"]
    setup = (f"{st['users']} users x {st['rounds']} rounds ({st['warmup_rounds']} warm-up), "
             f"system {st['system_tokens']} + history {st['history_tokens']} tokens, "
             f"questions {st['question_tokens']}, answers {st['answer_tokens']}; "
             f"{st['rate']:g} req/s Poisson, {record['clock']} clock; "
             f"engine KV {record['engine_kv_tokens']:,} tokens, "
             f"CPU tier {record['cpu_capacity'] / 2**20:,.0f} MiB, chunk {st['chunk_size']}")
    save_figure(fig, path, record, setup)
    close_figure(fig)
