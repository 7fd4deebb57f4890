"""``kvlayer bench vllm``: TTFT inside vLLM's own engine, vLLM's caches against kvlayer's tiers.

Each configuration runs in a vLLM engine of its own (``vllm_runner``, in-process vLLM mode),
one after the other, on the same random-weight model and the same prompts (per length n: a
prefix of n tokens plus a fresh ``--suffix``):

- ``recompute``: vLLM alone, prefix caching off;
- ``prefix-cache``: vLLM's own prefix cache holding the prefix (the floor a cache can reach);
- ``offloading``: vLLM's ``OffloadingConnector`` (its own CPU offloading), and ``lmcache``:
  LMCache's connector, where they start (the table says why where they do not);
- ``cpu``, ``nvme``, ``redis``: kvlayer with only that tier (vLLM's prefix caching off, so the
  prefix comes from kvlayer): ``miss`` is the first prompt (the all-miss that stores it),
  ``hit`` the median of ``--repeat`` prompts sharing its prefix.

Ratios, each of two figures of this run: kvlayer's hit over vLLM's prefix-cache hit (goal at
the longest length for cpu: <= 1.25), kvlayer's hit over ``offloading``'s (goal <= 1), and each
configuration's miss over ``recompute`` (what an all-miss costs, pair by pair).

Example: ``kvlayer bench vllm --lengths 1024,2048,4096,8192 --plot vllm.png --json vllm.json``;
``--tp 2`` runs every configuration with two tensor-parallel ranks (kvlayer: a shard per rank).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.common import (
    add_plot_argument,
    close_figure,
    default_model,
    machine_info,
    model_facts,
    new_figure,
    positive_int,
    positive_ints,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.stats import ratio

CONFIGS = ("recompute", "prefix-cache", "offloading", "lmcache", "cpu", "nvme", "redis")
KVLAYER = ("cpu", "nvme", "redis")
GOAL_PREFIX_CACHE = 1.25


def _configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        what = bad[0] if bad else text
        raise argparse.ArgumentTypeError(f"unknown configuration {what!r}; known: {','.join(CONFIGS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=positive_ints, default="1024,2048,4096,8192", help="cached prefix lengths")
    p.add_argument("--suffix", type=positive_int, default=32, help="new tokens after the prefix")
    p.add_argument("--repeat", type=positive_int, default=3, help="hits measured per length (median kept)")
    p.add_argument("--configs", type=_configs, default=",".join(CONFIGS), help=f"of {','.join(CONFIGS)}")
    p.add_argument("--chunk-size", type=positive_int, default=256, help="kvlayer's chunk (a multiple of 128)")
    p.add_argument("--block-size", type=positive_int, default=128, help="vLLM's block size (CPU: a multiple of 32)")
    p.add_argument("--itl", action="store_true",
                   help="instead: decode streams' inter-token latency while a prefix loads, sync vs async "
                        "(benchmarks/vllm_itl.py; the first of --lengths)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="vLLM's tensor_parallel_size for every configuration (its 'mp' executor; on the CPU build "
                        "each rank gets its own cores unless VLLM_CPU_OMP_THREADS_BIND is set)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="model dtype (float32 on these CPUs; bfloat16 for FlashAttention on CUDA)")
    add_plot_argument(p)


def config_spec(name: str, args: argparse.Namespace, model: str, vocab: int, folder: str,
                redis_url: str | None) -> dict[str, Any]:
    """The runner's spec for configuration ``name`` (``args``: lengths, suffix, repeat, chunk and
    block sizes, dtype)."""
    spec: dict[str, Any] = {"model": model, "lengths": args.lengths, "suffix": args.suffix, "repeat": args.repeat,
                            "vocab": vocab, "block_size": args.block_size, "dtype": args.dtype,
                            "max_model_len": max(args.lengths) + args.suffix + 16,
                            "prefix_caching": name == "prefix-cache", "connector": None, "extra": {},
                            "tensor_parallel_size": args.tp}
    kv: dict[str, Any] = {"chunk_size": args.chunk_size, "cpu_capacity": 0}
    if name == "cpu":
        kv["cpu_capacity"] = "4GiB"
    elif name == "nvme":
        kv.update(nvme_path=str(Path(folder) / "nvme"), nvme_capacity="16GiB")
    elif name == "redis":
        kv.update(redis_url=redis_url)
    if name in KVLAYER:
        spec.update(connector="kvlayer", extra=kv)
    elif name == "offloading":
        spec.update(connector="offloading", extra={"cpu_bytes_to_use": 4 << 30})
    elif name == "lmcache":
        spec["connector"] = "lmcache"
    return spec


def run_config(spec: dict[str, Any], folder: str, advance: Any) -> dict[str, Any]:
    """One configuration's engine: its start-up, its rows, or the error that stopped it."""
    if spec["connector"] == "lmcache" and importlib.util.find_spec("lmcache") is None:
        advance(len(spec["lengths"]))
        return {"error": "the lmcache package is not installed"}
    path = Path(tempfile.mkstemp(suffix=".json", dir=folder)[1])
    path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    tp = spec.get("tensor_parallel_size", 1)
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank_cores(tp, os.cpu_count() or 1)
    proc = subprocess.Popen([sys.executable, "-m", "kvlayer.benchmarks.vllm_runner", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    out: dict[str, Any] = {"rows": []}
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        item = json.loads(line)
        if "length" in item:
            out["rows"].append(item)
            advance()
        else:
            out.update(item)
    proc.wait()
    advance(len(spec["lengths"]) - len(out["rows"]))
    if not out["rows"] and "error" not in out:
        out["error"] = f"the vLLM runner exited with {proc.returncode}"
    return out


def rank_cores(ranks: int, cores: int) -> str:
    """vLLM CPU's ``VLLM_CPU_OMP_THREADS_BIND`` giving ``ranks`` ranks a share each of ``cores``
    cores ("0|1" for 2 of 2, "0-7|8-15" for 2 of 16); ranks share core 0 when there are fewer."""
    if cores < ranks:
        return "|".join("0" for _ in range(ranks))
    share = cores // ranks
    return "|".join(str(r * share) if share == 1 else f"{r * share}-{(r + 1) * share - 1}" for r in range(ranks))


def main(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("kvlayer bench vllm needs vLLM: pip install 'kvlayer[vllm]'")
    model = args.model or default_model(args.home, "bench")
    facts = model_facts(model, "cpu")
    if args.chunk_size % args.block_size:
        raise ValueError(f"--chunk-size {args.chunk_size} must be a multiple of --block-size {args.block_size}")
    if args.itl:
        from kvlayer.benchmarks import vllm_itl

        return vllm_itl.main(args, model, facts["vocab"])
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvlayer-bench-vllm-", dir=args.home) as folder:
        redis = _redis() if "redis" in args.configs else None
        try:
            url = redis.__enter__().url if redis is not None else None
            with progress(len(args.configs) * len(args.lengths), "bench vllm") as advance:
                for name in args.configs:
                    if name == "redis" and url is None:
                        results[name] = {"error": "redis-server is not installed", "rows": []}
                        advance(len(args.lengths))
                        continue
                    spec = config_spec(name, args, model, facts["vocab"], folder, url)
                    results[name] = run_config(spec, folder, advance)
        finally:
            if redis is not None:
                redis.__exit__()
    record = build_record(args, facts, results)
    report(record)
    write_json(args.json, record)
    plot(args.plot, record)
    return 0


def _redis() -> Any:
    from kvlayer.benchmarks.redis_local import LocalRedis

    return LocalRedis() if LocalRedis.available() else None


def build_record(args: argparse.Namespace, facts: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict:
    """The JSON record: per configuration its rows (or error), and the ratios of the module docstring."""
    by = {name: {r["length"]: r for r in res.get("rows", [])} for name, res in results.items()}
    ratios = []
    for n in args.lengths:
        for name in KVLAYER:
            hit = by.get(name, {}).get(n, {}).get("hit_s")
            ratios.append({"length": n, "config": name,
                           "over_prefix_cache": ratio(hit, by.get("prefix-cache", {}).get(n, {}).get("hit_s")),
                           "over_offloading": ratio(hit, by.get("offloading", {}).get(n, {}).get("hit_s"))})
        for name in results:
            miss = by[name].get(n, {}).get("miss_s")
            ratios.append({"length": n, "config": name, "miss_over_recompute":
                           ratio(miss, by.get("recompute", {}).get(n, {}).get("miss_s"))})
    reference = {n: r.get("tokens") for n, r in by.get("recompute", {}).items()}
    differ = sorted({name for name in by for n, r in by[name].items()
                     if reference.get(n) is not None and r.get("tokens") not in (None, reference[n])})
    return {"bench": "vllm", "machine": machine_info("cpu"), "model": facts, "settings": settings_of(args),
            "configs": results, "ratios": ratios, "tokens_differ": differ if reference else None}


def report(record: dict[str, Any]) -> None:
    rows = []
    for name, res in record["configs"].items():
        if res.get("error"):
            rows.append([name, "-", None, None, None, f"did not run: {res['error']}"])
        for r in res.get("rows", []):
            rows.append([name, r["length"], r["miss_s"], r["hit_s"], r["cached"], ""])
    tp = record["settings"].get("tp", 1)
    print_table(f"bench vllm: TTFT inside vLLM ({record['model']['name']}, float32, CPU, TP {tp})",
                ["config", "prefix", "first (miss) s", "hit s", "cached", "note"], rows)
    pairs = [[r["length"], r["config"], r.get("over_prefix_cache"), r.get("over_offloading")]
             for r in record["ratios"] if "over_prefix_cache" in r]
    print_table("kvlayer's hit over vLLM's own (same run)",
                ["prefix", "tier", "/ prefix-cache hit", "/ offloading hit"], pairs)
    misses = [[r["length"], r["config"], r["miss_over_recompute"]]
              for r in record["ratios"] if "miss_over_recompute" in r]
    print_table("first request (all miss) over recompute", ["prefix", "config", "ratio"], misses)
    if record["tokens_differ"] is not None:
        differ = record["tokens_differ"]
        print("greedy tokens: " + (f"differ from recompute's for {', '.join(differ)}" if differ
                                   else "every configuration's equal recompute's, hits included"))
    longest = max(record["settings"]["lengths"])
    cpu = next((r["over_prefix_cache"] for r in record["ratios"]
                if r.get("config") == "cpu" and r["length"] == longest and "over_prefix_cache" in r), None)
    if cpu is not None:
        verdict = "met" if cpu <= GOAL_PREFIX_CACHE else "NOT met"
        print(f"cpu hit at {longest} tokens: {cpu:.2f}x vLLM's prefix-cache hit "
              f"(goal <= {GOAL_PREFIX_CACHE}): {verdict}")


def plot(path: str | None, record: dict[str, Any]) -> None:
    if not path:
        return
    fig, axes = new_figure(1, 1, (8, 4.8))
    ax = axes[0][0]
    for name, res in record["configs"].items():
        rows = res.get("rows", [])
        if rows:
            key = "miss_s" if name == "recompute" else "hit_s"
            ax.plot([r["length"] for r in rows], [r[key] for r in rows], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="cached prefix tokens", ylabel="TTFT s", title="TTFT inside vLLM")
    ax.legend(fontsize=8)
    save_figure(fig, path, record, f"suffix {record['settings']['suffix']} tokens; one vLLM engine per configuration")
    close_figure(fig)
