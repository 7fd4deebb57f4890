"""The table, the ratios and the figure of ``kvlayer bench fleet`` (benchmarks/fleet_bench.py).

``report`` prints one row per configuration and the ratios (``kv`` over ``round-robin`` against
the goal, P/D over colocated) and returns them for the record; ``plot`` draws mean and p90
TTFT, generated tokens/s with the cached share, and the requests each instance answered.
"""

from __future__ import annotations

from typing import Any

from kvlayer.benchmarks.common import close_figure, new_figure, print_table, save_figure
from kvlayer.benchmarks.stats import ratio

GOAL_TTFT_X, GOAL_TOKS_X = 0.5, 1.5
"""``kv`` over ``round-robin``: mean TTFT at most this, generated tokens/s at least this."""


def report(results: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any]:
    """Print the table and the ratios; returns the ratios (None where a side is missing)."""
    roles = {c["name"]: c["roles"] for c in record["configs"]}
    cols = ["config", "instances", "requests", "failed", "cached", "TTFT mean s", "p90", "ITL mean s", "gen tok/s",
            "req/s", "requests per instance", "mean load", "computed tokens"]
    rows = [[r["label"], "+".join(roles[r["label"]]), r["requests"], r["failed"], r["cached_share"],
             r["ttft_s"]["mean"], r["ttft_s"]["p90"], r["itl_s"]["mean"], r["generated_tok_per_s"],
             r["request_per_s"], _per_instance(r, "requests", "{}"), _per_instance(r, "mean_load", "{:.2f}"),
             _per_instance(r, "computed_prompt_tokens", "{:,}")] for r in results]
    print_table(f"fleet: {record['model']['name']} through kvlayer router", cols, rows)
    for r in results:
        for f in r["failures"]:
            print(f"{r['label']}: failed: {f['count']} x {f['status'] or 'no response'}: {f['error']}")
        if r["router"]["lookup_failures"]:
            print(f"note: {r['label']}: {r['router']['lookup_failures']} prefix lookups missed their deadline "
                  "(those requests were routed by load)")
        if r["router"]["pd_prefills"]:
            routed = _per_instance(r, "routed_total", "{}")
            print(f"note: {r['label']}: requests per instance counts the answering (decode) instance; the router "
                  f"sent {r['router']['pd_prefills']} prefills too, warm-up included (routed: {routed})")
    by = {r["label"]: r for r in results}
    goals = {"kv_over_round_robin": _ratios(by.get("kv"), by.get("round-robin")),
             "pd_over_colocated": _ratios(by.get("pd"), by.get("colocated"))}
    kv = goals["kv_over_round_robin"]
    met = None
    if kv["mean_ttft"] is not None and kv["gen_tok_s"] is not None:
        met = kv["mean_ttft"] <= GOAL_TTFT_X and kv["gen_tok_s"] >= GOAL_TOKS_X
        print(f"kv / round-robin: mean TTFT {kv['mean_ttft']:.2f}x, generated tokens/s {kv['gen_tok_s']:.2f}x, "
              f"cached share {_share(by['kv'])} vs {_share(by['round-robin'])}  (goal: TTFT <= {GOAL_TTFT_X:g}x "
              f"and tokens/s >= {GOAL_TOKS_X:g}x: {'met' if met else 'MISSED'})")
    else:
        print("kv / round-robin: not measured (needs both policies in --policies)")
    kv.update(goal=f"mean TTFT <= {GOAL_TTFT_X:g}x and generated tokens/s >= {GOAL_TOKS_X:g}x", met=met)
    pd = goals["pd_over_colocated"]
    if pd["mean_ttft"] is not None and pd["gen_tok_s"] is not None:
        print(f"pd / colocated: mean TTFT {pd['mean_ttft']:.2f}x, generated tokens/s {pd['gen_tok_s']:.2f}x "
              "(P/D's cached share counts the KV its decode instance loaded from Redis)")
    elif record["pd_skipped"]:
        print(f"pd / colocated: not measured ({record['pd_skipped']})")
    return goals


def _ratios(ours: dict[str, Any] | None, base: dict[str, Any] | None) -> dict[str, Any]:
    if ours is None or base is None:
        return {"mean_ttft": None, "p90_ttft": None, "gen_tok_s": None}
    return {"mean_ttft": _finite(ratio(ours["ttft_s"]["mean"], base["ttft_s"]["mean"])),
            "p90_ttft": _finite(ratio(ours["ttft_s"]["p90"], base["ttft_s"]["p90"])),
            "gen_tok_s": _finite(ratio(ours["generated_tok_per_s"], base["generated_tok_per_s"]))}


def _finite(x: float | None) -> float | None:
    return x if x is not None and x == x else None  # NaN (no succeeded request) is no ratio


def _share(r: dict[str, Any]) -> str:
    return "-" if r["cached_share"] is None else f"{r['cached_share']:.2f}"


def _per_instance(r: dict[str, Any], key: str, fmt: str) -> str:
    return " ".join(f"{name}:{'-' if v[key] is None else fmt.format(v[key])}" for name, v in r["instances"].items())


def check_results(results: list[dict[str, Any]]) -> None:
    """ValueError (exit 2, after the table and JSON) when a configuration had no measured
    request succeed, naming its first failure."""
    for r in results:
        if not r["succeeded"]:
            first = r["failures"][0] if r["failures"] else {"status": None, "error": "no request"}
            raise ValueError(f"{r['label']}: all {r['failed']} measured requests failed, the first with "
                             f"{first['status'] or 'no response'}: {first['error']}")


def plot(path: str | None, results: list[dict[str, Any]], rows: dict[str, list[dict[str, Any]]],
         record: dict[str, Any]) -> None:
    if not path:
        return
    names = [r["label"] for r in results]
    x = list(range(len(names)))
    fig, axes = new_figure(1, 4, (19, 4.8))
    ax_t, ax_tok, ax_inst, ax_req = axes[0]
    ax_t.bar([i - 0.2 for i in x], [r["ttft_s"]["mean"] for r in results], 0.4, label="mean")
    ax_t.bar([i + 0.2 for i in x], [r["ttft_s"]["p90"] for r in results], 0.4, label="p90")
    ax_t.set_xticks(x, names, rotation=20)
    ax_t.set(ylabel="TTFT s", title="TTFT")
    ax_t.legend(fontsize=8)
    ax_tok.bar(x, [r["generated_tok_per_s"] or 0 for r in results], 0.5, color="tab:green")
    ax_tok.set_xticks(x, names, rotation=20)
    ax_tok.set(ylabel="generated tok/s", title="generated tokens/s (bars), cached share (dots)")
    ax_share = ax_tok.twinx()
    ax_share.plot(x, [r["cached_share"] or 0 for r in results], "o", color="black")
    ax_share.set(ylabel="cached share of prompt tokens", ylim=(0, 1.05))
    instances = sorted({i for r in results for i in r["instances"]})
    bottom = [0.0] * len(results)
    for inst in instances:
        counts = [r["instances"].get(inst, {}).get("requests", 0) for r in results]
        ax_inst.bar(x, counts, 0.5, bottom=bottom, label=inst)
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax_inst.set_xticks(x, names, rotation=20)
    ax_inst.set(ylabel="measured requests", title="requests per instance")
    ax_inst.legend(fontsize=8, title="instance")
    for name, rs in rows.items():
        ok = [r for r in rs if r["ttft_s"] is not None]
        ax_req.plot([r["submit_s"] for r in ok], [r["ttft_s"] for r in ok], marker=".", linestyle="", label=name)
    ax_req.set(xlabel="submitted at (wall clock) s", ylabel="TTFT s", yscale="log", title="TTFT per request")
    ax_req.legend(fontsize=8)
    st, z = record["settings"], record["sizes"]
    fig.suptitle(f"kvlayer bench fleet: {st['instances']} instances per policy, through kvlayer router")
    setup = (f"{st['users']} users x {st['rounds']} rounds ({st['warmup_rounds']} warm-up) at {st['rate']:g} req/s, "
             f"system {st['system_tokens']} + history {st['history_tokens']}, questions {st['question_tokens']}, "
             f"answers {st['answer_tokens']}; per instance: 1 torch thread, engine KV {z['engine_kv_tokens']:,} "
             f"tokens, CPU tier {z['cpu_capacity_tokens']:,} tokens, chunk {st['chunk_size']}")
    save_figure(fig, path, record, setup)
    close_figure(fig)
