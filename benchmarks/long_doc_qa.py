"""``kvlayer bench long-doc-qa``: documents queried again and again, more of them than the upper tiers hold.

``--docs`` documents of ``--doc-tokens`` tokens are each queried ``--queries`` times in a
shuffled order (no document twice in a row), one query at a time (each waits for the
previous answer). The engine's KV capacity (just over one request) and kvlayer's CPU tier
(``--cpu-capacity``, default two documents) are kept small, so the documents' KV is served
from NVMe or Redis. Reports TTFT, hit rate per tier and the share of repeated-document
tokens that kvlayer served (goal: >= 90% for the configurations with NVMe or Redis).

With ``--endpoint URL`` the same queries go to an OpenAI-compatible server instead (``kvlayer
serve``, ``vllm serve`` ...) over HTTP on the wall clock, and ``repeat: cached`` is the share of
repeated-document tokens the server reported cached; the in-process flags (``--configs``, the
tier capacities, ``--layerwise``, ``--device``) are refused then: one run per server, named by
``--label`` (benchmarks/http_bench.py).

Example: ``kvlayer bench long-doc-qa --configs recompute,cpu+nvme,nvme --plot ldqa.png``;
over HTTP: ``kvlayer bench long-doc-qa --endpoint http://127.0.0.1:8000 --model MODEL_DIR --label ours``
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

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
from kvlayer.benchmarks.configs import add_config_arguments, factory_from_args, parse_configs
from kvlayer.benchmarks.http_bench import HttpWorkload, add_http_arguments, http_mode, run_http
from kvlayer.benchmarks.serving import EngineSize, hit_columns, plot_sources, request_rows, serve
from kvlayer.benchmarks.workloads import DocQueries, LongDocSpec, Turn

if TYPE_CHECKING:
    from kvlayer.benchmarks.http_driver import HttpRecord

GOAL_REUSE = 0.9
IN_PROCESS = ("configs", "chunk_size", "cpu_capacity", "nvme_capacity", "cache_dir", "redis_url", "layerwise",
              "device")
"""The flags of the in-process mode only (refused with ``--endpoint``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=positive_int, default=8)
    p.add_argument("--doc-tokens", type=positive_int, default=2048)
    p.add_argument("--queries", type=positive_int, default=3, help="queries per document (the first one is a miss)")
    p.add_argument("--question-tokens", type=positive_int, default=32)
    p.add_argument("--answer-tokens", type=positive_int, default=8)
    p.add_argument("--layerwise", choices=("auto", "on", "off"), default="on",
                   help="kvlayer's layer-by-layer loading (the config key layerwise)")
    p.add_argument("--seed", type=int, default=0)
    add_config_arguments(p, "recompute,engine,cpu,cpu+nvme,nvme,redis", cpu_capacity="auto")
    add_plot_argument(p)
    add_http_arguments(p, IN_PROCESS)


def main(args: argparse.Namespace) -> int:
    spec = LongDocSpec(args.docs, args.doc_tokens, args.queries, args.question_tokens, args.answer_tokens,
                       args.seed)
    if http_mode(args):
        return run_http(args, http_workload(spec), IN_PROCESS)
    names = parse_configs(args.configs)
    model = args.model or default_model(args.home, "bench")
    need = -(-spec.request_tokens() // 16)
    size = EngineSize(-(-need * 5 // 4))
    per_token = model_facts(model, args.device)["kv_bytes_per_token"]
    cpu = None if args.cpu_capacity != "auto" else 2 * spec.doc_tokens * per_token
    results, records = [], {}
    with factory_from_args(args, names, kvlayer_prefix_caching=True, cpu_capacity=cpu) as factory:
        names = factory.available(names)
        docs_kv = spec.total_doc_tokens() * per_token
        print(f"long-doc-qa: {spec.docs} documents x {spec.doc_tokens} tokens, {spec.queries} queries each; "
              f"documents' KV {docs_kv / 2**20:,.0f} MiB vs engine KV {size.tokens:,} tokens and CPU tier "
              f"{factory.sizes.cpu_capacity / 2**20:,.0f} MiB")
        queries = DocQueries(spec, model_facts(model)["vocab"])
        turns = queries.turns()
        with progress(len(names) * len(turns), "long-doc-qa") as advance:
            for name in names:
                config = factory.build(name, layerwise=args.layerwise)
                summary, recs = serve(model, args.device, config, size, [], turns, lambda _: queries,
                                            spec.answer_tokens, "sim", advance)
                summary["reuse"] = reuse(spec, queries, recs)
                results.append(summary)
                records[name] = request_rows(recs)
    record = {"bench": "long-doc-qa", "machine": machine_info(args.device), "model": model_facts(model, args.device),
              "settings": settings_of(args), "engine_kv_tokens": size.tokens,
              "cpu_capacity": factory.sizes.cpu_capacity, "results": results, "requests": records}
    report(results, record)
    write_json(args.json, record)
    plot(args.plot, results, records, record)
    return 0


def reuse(spec: LongDocSpec, queries: DocQueries, records: list[Any]) -> dict[str, Any]:
    """Of the document tokens of repeated queries: the share kvlayer and the engine's cache served."""
    repeated = [r for r in records if queries.repeated(r.turn.index)]
    total = spec.doc_tokens * len(repeated)
    kv = sum(min(r.num_external, spec.doc_tokens) for r in repeated)
    eng = sum(min(r.num_cached, spec.doc_tokens) for r in repeated)
    return {"repeated_queries": len(repeated), "repeated_doc_tokens": total,
            "from_kvlayer": kv / total if total else None, "from_engine": eng / total if total else None}


def http_workload(spec: LongDocSpec) -> HttpWorkload:
    """The queries of ``main``'s in-process run, for the HTTP mode (one user, one at a time)."""
    def build(vocab: int) -> tuple[DocQueries, list[Turn], list[Turn]]:
        queries = DocQueries(spec, vocab)
        return queries, [], queries.turns()

    setup = (f"{spec.docs} documents x {spec.doc_tokens} tokens, {spec.queries} queries each (question "
             f"{spec.question_tokens}, answer {spec.answer_tokens}), one at a time")
    return HttpWorkload("long-doc-qa", 1, spec.answer_tokens, build, setup,
                        lambda queries, records: http_reuse(spec, queries, records))


def http_reuse(spec: LongDocSpec, queries: DocQueries, records: list[HttpRecord]) -> dict[str, float | None]:
    """Of the document tokens of repeated queries that succeeded with cached tokens reported:
    the share the server reported cached (None when there are none)."""
    repeated = [r for r in records if queries.repeated(r.turn.index) and r.result.cached_tokens is not None]
    total = spec.doc_tokens * len(repeated)
    cached = sum(min(r.result.cached_tokens or 0, spec.doc_tokens) for r in repeated)
    return {"repeat: cached": cached / total if total else None}


def report(results: list[dict[str, Any]], record: dict[str, Any]) -> None:
    tiers = hit_columns(results)
    cols = ["config", "TTFT mean s", "p50", "p90", "p99", "unqueued s", *[f"hit {t}" for t in tiers], "recomputed",
            "repeat: kvlayer", "repeat: engine"]
    rows = [[r["config"], r["ttft_s"]["mean"], r["ttft_s"]["p50"], r["ttft_s"]["p90"], r["ttft_s"]["p99"],
             r["unqueued_ttft_s"]["mean"],
             *[r["hit_rate"].get(t) for t in tiers], r["recomputed"], r["reuse"]["from_kvlayer"],
             r["reuse"]["from_engine"]] for r in results]
    print_table(f"long-doc-qa: {record['model'].get('name')}", cols, rows)
    for r in results:
        kv = r["kvlayer"]
        if kv is None or not (kv.get("nvme_path") or kv.get("redis_url")):
            continue
        share = r["reuse"]["from_kvlayer"] or 0.0
        r["reuse"]["goal_met"] = share >= GOAL_REUSE
        print(f"{r['config']}: {100 * share:.1f}% of repeated-document tokens served from kvlayer "
              f"(goal >= {100 * GOAL_REUSE:.0f}%: {'met' if share >= GOAL_REUSE else 'MISSED'})")


def plot(path: str | None, results: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]],
         record: dict[str, Any]) -> None:
    if not path:
        return
    fig, axes = new_figure(1, 2, (13, 4.8))
    ax_t, ax_hit = axes[0]
    for name, rows in records.items():
        ax_t.plot(range(len(rows)), [r["ttft_s"] for r in rows], marker=".", label=name)
    ax_t.set(xlabel="query", ylabel="TTFT s", yscale="log", title="TTFT per query (first queries miss)")
    ax_t.legend(fontsize=8)
    plot_sources(ax_hit, results)
    fig.suptitle("long-doc-qa")
    st = record["settings"]
    setup = (f"{st['docs']} documents x {st['doc_tokens']} tokens, {st['queries']} queries each (question "
             f"{st['question_tokens']}, answer {st['answer_tokens']}); engine KV {record['engine_kv_tokens']:,} "
             f"tokens, CPU tier {record['cpu_capacity'] / 2**20:,.0f} MiB, chunk {st['chunk_size']}")
    save_figure(fig, path, record, setup)
    close_figure(fig)
