"""``kvlayer bench miss-overhead``: what kvlayer costs a request it can never serve (issue 3: <= 2%).

Every request is a fresh random prompt of ``--length`` tokens with ``max_tokens=1``, so its time
is its TTFT and nothing is ever hit. One engine without kvlayer (``recompute``: no prefix cache)
is shared by every configuration; each kvlayer configuration gets its own engine, kvlayer below
it with the engine's prefix cache off. The two engines alternate request by request in ABBA
order (round i: off then on when i is even, on then off when odd), so a drift of the machine's
speed (a noisy 2-core box) falls on both alike. After each kvlayer request its background
writes are drained (``drain_s``, untimed in the TTFT) so they never spill into the next request;
the overhead with the drain added bounds what those writes could cost an engine that never idles.

Reported per configuration: the median TTFT off and on, the overhead of the medians
((on/off - 1) * 100), the spread of the per-round ratios, and the chunk writes kvlayer made
(puts, all tiers): proof that it did its work on every miss.

With ``--plot``: per configuration, the TTFT off and on in every round, and the overhead of the
medians with the spread of the per-round ratios against the goal.

Example: ``kvlayer bench miss-overhead --configs cpu,nvme --length 2048 --rounds 8 --plot miss.png``
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from kvlayer.benchmarks.common import (
    add_plot_argument,
    close_figure,
    default_model,
    machine_info,
    model_facts,
    new_figure,
    positive_int,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.configs import BASELINES, BenchConfig, add_config_arguments, factory_from_args, parse_configs
from kvlayer.benchmarks.stats import percentile
from kvlayer.benchmarks.ttft_measure import cache_engine, open_llm, ttft
from kvlayer.benchmarks.workloads import random_tokens

GOAL_PCT = 2.0
"""The most overhead on misses kvlayer issue 3 allows, in percent of the TTFT without kvlayer."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--length", type=positive_int, default=2048, help="prompt tokens of every request")
    p.add_argument("--rounds", type=positive_int, default=8,
                   help="request pairs (one without kvlayer, one with) per config")
    add_config_arguments(p, "cpu,nvme")
    add_plot_argument(p)


def main(args: argparse.Namespace) -> int:
    names = parse_configs(args.configs)
    if baselines := [n for n in names if n in BASELINES]:
        raise ValueError(f"--configs takes kvlayer configurations only, not {', '.join(baselines)}")
    model = args.model or default_model(args.home, "bench")
    facts = model_facts(model, args.device)
    rng = random.Random(0)
    with factory_from_args(args, names, kvlayer_prefix_caching=False) as factory:
        configs = [factory.build(n) for n in factory.available(names)]
        with progress(len(configs) * args.rounds, "miss-overhead") as advance, \
                open_llm(model, args.device, factory.build("recompute"), args.length) as off:
            results = {c.name: measure(off, model, args, c, lambda: random_tokens(rng, args.length, facts["vocab"]),
                                       advance) for c in configs}
    record = {"bench": "miss-overhead", "machine": machine_info(args.device), "model": facts,
              "settings": settings_of(args), "goal_pct": GOAL_PCT, "configs": results}
    report(record)
    write_json(args.json, record)
    plot(args.plot, record)
    return 0


def measure(off: Any, model: str, args: argparse.Namespace, config: BenchConfig,
            prompt: Callable[[], list[int]], advance: Callable[[], None]) -> dict[str, Any]:
    """``args.rounds`` ABBA rounds of ``off`` against a fresh engine running ``config``, each
    request a new ``prompt()``; the pairs, their summary (see ``summarize``) and the kvlayer
    counters the rounds moved (``put_chunks``, ``hit_tokens``: per tier)."""
    pairs = []
    with open_llm(model, args.device, config, args.length) as on:
        cache_engine(on).flush()  # the warm-up's writes
        before = on.kv_stats()
        for i in range(args.rounds):
            if i % 2 == 0:
                off_s = ttft(off, prompt())
                on_s, drain_s = _on_request(on, prompt())
            else:
                on_s, drain_s = _on_request(on, prompt())
                off_s = ttft(off, prompt())
            pairs.append({"round": i, "order": "off,on" if i % 2 == 0 else "on,off", "off_s": off_s,
                          "on_s": on_s, "drain_s": drain_s})
            advance()
        after = on.kv_stats()
    return {"kv_config": config.public_kv_config(), **summarize(pairs),
            "put_chunks": _moved(before, after, "put_chunks"), "hit_tokens": _moved(before, after, "hit_tokens")}


def _on_request(llm: Any, prompt: list[int]) -> tuple[float, float]:
    """TTFT of ``prompt`` through a kvlayer engine, then seconds until its background writes are done."""
    t = ttft(llm, prompt)
    start = time.perf_counter()
    cache_engine(llm).flush()
    return t, time.perf_counter() - start


def summarize(pairs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians of ``off_s``, ``on_s`` and ``drain_s``; ``overhead_pct`` = (median on / median off
    - 1) * 100 and whether it meets ``GOAL_PCT``; ``overhead_with_drain_pct`` the same with each
    request's drain added (an upper bound: what the background writes could cost a busy engine);
    ``pair_min_pct``/``pair_max_pct``: the extremes
    of the per-round (on/off - 1) * 100. ``pairs`` is kept as given."""
    off, on = (percentile([p[k] for p in pairs], 50) for k in ("off_s", "on_s"))
    per_round = [(p["on_s"] / p["off_s"] - 1) * 100 for p in pairs]
    overhead = (on / off - 1) * 100
    with_drain = (percentile([p["on_s"] + p["drain_s"] for p in pairs], 50) / off - 1) * 100
    return {"median_off_s": off, "median_on_s": on, "overhead_pct": overhead, "goal_met": overhead <= GOAL_PCT,
            "overhead_with_drain_pct": with_drain,
            "pair_min_pct": min(per_round), "pair_max_pct": max(per_round),
            "median_drain_s": percentile([p["drain_s"] for p in pairs], 50), "pairs": pairs}


def _moved(before: dict[str, Any], after: dict[str, Any], counter: str) -> dict[str, int]:
    """How much ``counter`` grew per tier between two ``LLM.kv_stats()``."""
    return {tier: int(t[counter]) - int(before["tiers"][tier][counter]) for tier, t in after["tiers"].items()}


def report(record: dict[str, Any]) -> None:
    """Print the table and the goal line."""
    rows = [[name, len(r["pairs"]), r["median_off_s"], r["median_on_s"], r["overhead_pct"], r["pair_min_pct"],
             r["pair_max_pct"], r["median_drain_s"], r["overhead_with_drain_pct"], sum(r["put_chunks"].values())]
            for name, r in record["configs"].items()]
    m, st = record["model"], record["settings"]
    print_table(f"bench miss-overhead: {m['name']} ({m['layers']} layers), {st['length']}-token prompts, "
                f"all misses, ABBA", ["config", "rounds", "TTFT off s", "TTFT on s", "overhead %", "pair min %",
                                      "pair max %", "drain s", "+ drain %", "chunk puts"], rows)
    verdicts = "; ".join(f"{name} {r['overhead_pct']:+.2f}% {'met' if r['goal_met'] else 'NOT met'}"
                         for name, r in record["configs"].items())
    print(f"goal: <= {record['goal_pct']:g}% (kvlayer issue 3): {verdicts}")


def plot(path: str | None, record: dict[str, Any]) -> None:
    """Left: TTFT per round without kvlayer (dashed) and with it (solid), one colour per
    configuration. Right: the overhead of the medians per configuration, its bar spanning the
    per-round extremes, the bound with the drain added (x) and the goal (dashed)."""
    if not path:
        return
    fig, axes = new_figure(1, 2, (13, 4.8))
    ax_r, ax_o = axes[0]
    names = list(record["configs"])
    for i, (name, r) in enumerate(record["configs"].items()):
        color = f"C{i}"
        rounds = [p["round"] for p in r["pairs"]]
        ax_r.plot(rounds, [p["off_s"] for p in r["pairs"]], "--", marker=".", color=color, label=f"{name}: off")
        ax_r.plot(rounds, [p["on_s"] for p in r["pairs"]], "-", marker="o", color=color, label=f"{name}: kvlayer")
    ax_r.set_xticks(range(record["settings"]["rounds"]))
    ax_r.set(xlabel="round (even: off then on; odd: on then off)", ylabel="TTFT s",
             title="TTFT per round: recompute (off) vs kvlayer (on)")
    ax_r.legend(fontsize=7)
    x = range(len(names))
    overhead = [record["configs"][n]["overhead_pct"] for n in names]
    spread = [[o - record["configs"][n]["pair_min_pct"] for n, o in zip(names, overhead)],
              [record["configs"][n]["pair_max_pct"] - o for n, o in zip(names, overhead)]]
    ax_o.bar(list(x), overhead, 0.5, yerr=spread, capsize=6, color=[f"C{i}" for i in x], label="overhead of medians")
    ax_o.plot(list(x), [record["configs"][n]["overhead_with_drain_pct"] for n in names], "kx", label="+ drain")
    ax_o.axhline(0.0, color="k", lw=0.8)
    ax_o.axhline(record["goal_pct"], color="0.4", ls="--", lw=1, label=f"goal <= {record['goal_pct']:g}%")
    ax_o.set_xticks(list(x), names)
    ax_o.set(ylabel="TTFT on / off - 1, %", title="overhead on misses (bars: per-round min..max)")
    ax_o.legend(fontsize=7)
    st = record["settings"]
    setup = (f"{st['length']}-token prompts, all misses, {st['rounds']} ABBA rounds per configuration, "
             f"chunk {st['chunk_size']}; one engine without kvlayer shared, kvlayer below engines with their "
             f"prefix cache off")
    save_figure(fig, path, record, setup)
    close_figure(fig)
