"""``kvlayer bench cache-server-mrqa``: multi-round QA over 2 engine processes, one shared cache
server against a private CPU tier per engine.

The bench starts everything itself: for each configuration, ``--engines`` bundled-engine
processes (benchmarks/cache_server_mrqa_worker.py, one torch thread each) that serve the
multi-round-QA users of ``kvlayer bench multi-round-qa`` (benchmarks/workloads.py) without a
router, user ``i`` on engine ``i % engines``; the users share a system prompt. Each engine has a
small engine KV cache (the largest request plus a block), so the users' histories come from
kvlayer or are recomputed. The same seeded workload runs under each configuration:

- ``shared``: one ``kvlayer cache-server`` of ``--capacity`` C bytes used by every engine
  (``cache_server``, ``cpu_capacity: 0``): the system prompt is stored once;
- ``split``: no server; each engine a private in-process CPU tier of C / engines.

C defaults (``auto``) to ``AUTO_FRACTION`` of the KV bytes that the shared server needs for the
whole working set (the system prompt once, every history; whole chunks), so both configurations
evict, the split one more (it keeps the system prompt once per engine). The engines' own prefix
cache is off by default (``--engine-prefix-cache``): every prompt token is then looked up in
kvlayer, so the hit rate is kvlayer's alone and the system prompt's chunks stay recently used.
With it on, kvlayer served nothing in a trial run (docs/benchmarks.md, "Node cache server").

Bytes held are also measured with room for everything (the ``-roomy`` runs, a capacity of
``engines`` x the split working set): there the private tiers together hold ``engines - 1``
more copies of the system prompt than the server.

Reported per configuration: hit rate (prompt tokens loaded from kvlayer / prompt tokens; the
engine's own prefix-cache share beside it), mean and p90 TTFT of the measured turns of all
engines together (simulated clocks, benchmarks/driver.py), and the bytes held at the end (the
server's ``used_bytes`` against the sum of the private tiers' ``used_bytes``). Exactness: for
each engine the ``--sample`` measured requests with the most kvlayer tokens are generated again
by an engine without kvlayer (one at a time); a token that differs is a RuntimeError.

``KVLAYER_SMOKE=1`` shrinks the run (``tiny`` model, 4 users, 2 rounds, short prompts).
Run: ``kvlayer bench cache-server-mrqa --json csmrqa.json`` (default model: a random ``small``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.common import (
    default_model,
    machine_info,
    model_facts,
    nonnegative_int,
    positive_float,
    positive_int,
    print_table,
    settings_of,
    size_or_auto,
    write_json,
)
from kvlayer.benchmarks.workloads import MultiRoundSpec
from kvlayer.sizes import parse_size

AUTO_FRACTION = 0.9
"""``--capacity auto``: this share of the KV the shared server needs for the whole working set."""
CONFIGS = ("shared", "split")
WORKER = "kvlayer.benchmarks.cache_server_mrqa_worker"
WORKER_TIMEOUT_S = 1800.0
SMOKE = {"users": 4, "rounds": 2, "system_tokens": 128, "history_tokens": 64, "question_tokens": 8,
         "answer_tokens": 4, "chunk_size": 32, "sample": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench cache-server-mrqa`` (``--device`` is not used: CPU only)."""
    p.add_argument("--engines", type=positive_int, default=2, help="engine processes; user i on engine i %% N")
    p.add_argument("--users", type=positive_int, default=8)
    p.add_argument("--rounds", type=positive_int, default=6, help="questions per user, warm-up rounds included")
    p.add_argument("--warmup-rounds", type=nonnegative_int, default=1, help="served before measuring")
    p.add_argument("--system-tokens", type=nonnegative_int, default=2048, help="the system prompt all users share")
    p.add_argument("--history-tokens", type=nonnegative_int, default=512, help="each user's own history")
    p.add_argument("--question-tokens", type=positive_int, default=32)
    p.add_argument("--answer-tokens", type=positive_int, default=8)
    p.add_argument("--rate", type=positive_float, default=2.0, help="request arrivals per second (Poisson)")
    p.add_argument("--chunk-size", type=positive_int, default=256, help="kvlayer chunk size in tokens")
    p.add_argument("--capacity", type=size_or_auto, default="auto",
                   help=f"the server's capacity C (each private tier: C / engines); auto: {AUTO_FRACTION:g} x "
                        f"the working set's KV")
    p.add_argument("--engine-prefix-cache", choices=("on", "off"), default="off",
                   help="the engines' own prefix cache (off: every prompt token is looked up in kvlayer)")
    p.add_argument("--sample", type=positive_int, default=2, help="requests per engine checked for exact tokens")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    """Run every configuration and the exactness check, print the table, write ``--json``; 0."""
    notes: list[str] = []
    smoke = os.environ.get("KVLAYER_SMOKE") == "1"
    if smoke:
        args = argparse.Namespace(**{**vars(args), **SMOKE})
        notes.append("KVLAYER_SMOKE=1: tiny sizes (" + ", ".join(f"{k} {v}" for k, v in SMOKE.items()) + ")")
    if args.warmup_rounds >= args.rounds:
        raise ValueError(f"--warmup-rounds must be below --rounds ({args.rounds}), got {args.warmup_rounds}")
    spec = MultiRoundSpec(args.users, args.rounds, args.system_tokens, args.history_tokens, args.question_tokens,
                          args.answer_tokens, args.seed)
    model = args.model or default_model(args.home, "tiny" if smoke else "small")
    facts = model_facts(model, "cpu")
    per_token = int(facts["kv_bytes_per_token"])
    need = stored_tokens(spec, args.chunk_size, args.engines)
    capacity = auto_capacity(need["shared"], args.chunk_size, args.engines) * per_token if args.capacity == "auto" \
        else parse_size(args.capacity)
    from kvlayer.benchmarks.multi_round_qa import engine_size

    blocks = engine_size(spec, 0).num_gpu_blocks
    print(f"cache-server-mrqa: {spec.users} users x {spec.rounds} rounds over {args.engines} engines; KV the "
          f"working set needs: shared {need['shared'] * per_token / 2**20:.1f} MiB, split "
          f"{need['split'] * per_token / 2**20:.1f} MiB; capacity C = {capacity / 2**20:.1f} MiB")
    roomy = args.engines * need["split"] * per_token + 2 * args.chunk_size * per_token
    runs = {name: (name, capacity) for name in CONFIGS} | {f"{name}-roomy": (name, roomy) for name in CONFIGS}
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvcs-mrqa-") as folder:
        for label, (name, cap) in runs.items():
            start = time.perf_counter()
            results[label] = run_config(name, Path(folder, label), model, spec, args, cap, blocks)
            print(f"{label}: {time.perf_counter() - start:.0f} s")
    checks = check_exact(model, results, blocks)
    system_bytes = spec.system_tokens // args.chunk_size * args.chunk_size * per_token
    record = {"bench": "cache-server-mrqa", "machine": machine_info("cpu"), "model": facts,
              "settings": settings_of(args), "notes": notes, "capacity_bytes": capacity,
              "working_set_bytes": {k: v * per_token for k, v in need.items()}, "engine_kv_tokens": blocks * 16,
              "roomy_capacity_bytes": roomy, "system_prompt_bytes": system_bytes,
              "results": results, "exact": checks, "comparison": compare(results)}
    report(record)
    write_json(args.json, record)
    return 0


def stored_tokens(spec: MultiRoundSpec, chunk: int, engines: int) -> dict[str, int]:
    """Tokens of whole chunks kvlayer keeps for the whole working set: ``shared`` (the system
    prompt once) and ``split`` (once per engine that serves a user)."""
    system = spec.system_tokens // chunk * chunk
    users = spec.max_request_tokens() // chunk * chunk - system
    served = min(engines, spec.users)
    return {"shared": system + spec.users * users, "split": served * system + spec.users * users}


def auto_capacity(shared_tokens: int, chunk: int, engines: int) -> int:
    """``--capacity auto`` in tokens: ``AUTO_FRACTION`` of ``shared_tokens`` rounded down to whole
    chunks for every engine's tier (at least one each)."""
    per_engine = max(1, int(AUTO_FRACTION * shared_tokens / chunk) // engines)
    return per_engine * engines * chunk


# --- one configuration ----------------------------------------------------------------------
def run_config(name: str, folder: Path, model: str, spec: MultiRoundSpec, args: argparse.Namespace,
               capacity: int, blocks: int) -> dict[str, Any]:
    """Serve the workload with ``name``'s tiers (module docstring); its summary, per-engine
    results and bytes held. RuntimeError (with the log's tail) if an engine process fails."""
    from kvlayer.benchmarks.cache_server_bench import server_process, server_stats

    folder.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        if name == "shared":
            sock = stack.enter_context(server_process(str(folder / "cache.sock"), capacity))
            kv: dict[str, Any] = {"chunk_size": args.chunk_size, "cpu_capacity": 0, "cache_server": sock}
        else:
            kv = {"chunk_size": args.chunk_size, "cpu_capacity": capacity // args.engines}
        engines = run_engines(folder, model, kv, spec, args, blocks)
        server = server_stats(sock) if name == "shared" else None
    held = server["used_bytes"] if server else sum(t["used_bytes"] for e in engines for t in e["tiers"].values())
    return {**summarize(engines), "bytes_held": held, "server": server, "engines": engines, "kv": kv}


def run_engines(folder: Path, model: str, kv: dict[str, Any], spec: MultiRoundSpec, args: argparse.Namespace,
                blocks: int) -> list[dict[str, Any]]:
    """Start the engine processes at once, wait for all; their results in engine order."""
    from kvlayer.benchmarks.cache_server_bench import child_env
    from kvlayer.benchmarks.cache_server_mrqa_worker import Job, job_json
    from kvlayer.benchmarks.fleet_procs import Child, stop_all

    spec_fields = {f: getattr(spec, f) for f in ("users", "rounds", "system_tokens", "history_tokens",
                                                 "question_tokens", "answer_tokens", "seed")}
    barrier = folder / "barrier"
    barrier.mkdir()
    children = []
    try:
        for i in range(args.engines):
            job = Job(model, kv, blocks, args.engine_prefix_cache == "on", i, args.engines, spec_fields, args.rate,
                      args.warmup_rounds, args.sample, str(barrier))
            (folder / f"job-{i}.json").write_text(job_json(job), encoding="utf-8")
            argv = [sys.executable, "-m", WORKER, str(folder / f"job-{i}.json"), str(folder / f"out-{i}.json")]
            children.append(Child(f"engine {i}", argv, folder / f"engine-{i}.log", child_env()))
        for child in children:
            if child.proc.wait(WORKER_TIMEOUT_S) != 0:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.tail(30)}")
    finally:
        stop_all(children)
    return [json.loads((folder / f"out-{i}.json").read_text(encoding="utf-8")) for i in range(args.engines)]


def summarize(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """Hit rates and TTFT over the measured requests of every engine together."""
    from kvlayer.benchmarks.stats import summarize as percentiles

    rows = [r for e in engines for r in e["requests"]]
    prompt = sum(r["prompt"] for r in rows)
    external = sum(r["external"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    return {"requests": len(rows), "prompt_tokens": prompt, "kvlayer_tokens": external, "engine_tokens": cached,
            "hit_rate": external / prompt if prompt else math.nan,
            "engine_hit_rate": cached / prompt if prompt else math.nan,
            "recomputed": 1 - (external + cached) / prompt if prompt else math.nan,
            "ttft_s": percentiles([r["ttft_s"] for r in rows])}


# --- exactness ------------------------------------------------------------------------------
def check_exact(model: str, results: dict[str, dict[str, Any]], blocks: int) -> dict[str, Any]:
    """Generate every sampled request again without kvlayer, one at a time (greedy, as served);
    the checked requests; RuntimeError on a token that differs."""
    from kvlayer.benchmarks.configs import BenchConfig, make_llm
    from kvlayer.engine import SamplingParams

    checked = []
    with make_llm(model, "cpu", BenchConfig("recompute", "recompute", False, None), num_gpu_blocks=blocks) as llm:
        for name, result in results.items():
            for engine in result["engines"]:
                for s in engine["samples"]:
                    params = SamplingParams(max_tokens=len(s["output"]), temperature=0, ignore_eos=True)
                    again = list(llm.generate([{"prompt_token_ids": s["prompt"]}], params)[0].outputs[0].token_ids)
                    if again != s["output"]:
                        raise RuntimeError(f"{name}, engine {engine['index']}, user {s['user']} turn {s['turn']}: "
                                           f"generated {s['output']} with kvlayer, {again} without")
                    checked.append({"config": name, "engine": engine["index"], "user": s["user"],
                                    "turn": s["turn"], "kvlayer_tokens": s["external"], "equal": True})
    return {"requests": checked, "all_equal": True}


# --- output ---------------------------------------------------------------------------------
def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Shared against split: hit rates, mean TTFT, bytes held, and whether sharing won."""
    sh, sp = results["shared"], results["split"]
    ttft_x = sp["ttft_s"]["mean"] / sh["ttft_s"]["mean"] if sh["ttft_s"]["mean"] else math.nan
    return {"hit_rate_shared": sh["hit_rate"], "hit_rate_split": sp["hit_rate"],
            "mean_ttft_split_over_shared": ttft_x,
            "bytes_held_shared_over_split": sh["bytes_held"] / sp["bytes_held"] if sp["bytes_held"] else math.nan,
            "roomy_bytes_held": {"shared": results["shared-roomy"]["bytes_held"],
                                 "split": results["split-roomy"]["bytes_held"],
                                 "duplicated": results["split-roomy"]["bytes_held"]
                                 - results["shared-roomy"]["bytes_held"]},
            "sharing_wins": sh["hit_rate"] > sp["hit_rate"] and sh["ttft_s"]["mean"] < sp["ttft_s"]["mean"]}


def report(record: dict[str, Any]) -> None:
    """Print the table and the comparison line."""
    rows = [[name, r["requests"], r["hit_rate"], r["engine_hit_rate"], r["recomputed"], r["ttft_s"]["mean"],
             r["ttft_s"]["p90"], r["bytes_held"] / 2**20] for name, r in record["results"].items()]
    cap = record["capacity_bytes"] / 2**20
    print_table(f"cache-server-mrqa: one server of {cap:.1f} MiB (shared) vs a private CPU tier of "
                f"{cap / record['settings']['engines']:.1f} MiB per engine (split), {record['model'].get('name')}",
                ["config", "requests", "hit kvlayer", "hit engine", "recomputed", "TTFT mean s", "p90",
                 "MiB held"], rows)
    c, ex = record["comparison"], record["exact"]
    print(f"shared vs split: hit rate {c['hit_rate_shared']:.3f} vs {c['hit_rate_split']:.3f}, mean TTFT "
          f"split/shared = {c['mean_ttft_split_over_shared']:.2f}x, bytes held shared/split = "
          f"{c['bytes_held_shared_over_split']:.2f} (goal: sharing wins on hit rate and mean TTFT: "
          f"{'met' if c['sharing_wins'] else 'NOT met'})")
    roomy = c["roomy_bytes_held"]
    print(f"bytes held with room for everything ({record['roomy_capacity_bytes'] / 2**20:.1f} MiB): shared "
          f"{roomy['shared'] / 2**20:.2f} MiB, split {roomy['split'] / 2**20:.2f} MiB (split holds "
          f"{roomy['duplicated'] / 2**20:.2f} MiB more; the system prompt is "
          f"{record['system_prompt_bytes'] / 2**20:.2f} MiB)")
    print(f"exact: {len(ex['requests'])} sampled requests generated the same tokens without kvlayer")
    for note in record["notes"]:
        print(f"note: {note}")
