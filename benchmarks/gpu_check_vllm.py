"""The vLLM part of ``kvlayer.benchmarks.gpu_check``: kvlayer's connector inside vLLM on CUDA.

With vLLM's CUDA build installed (the package ``vllm``), on the check's ~1B-parameter model in
bfloat16 (FlashAttention's layout, kvlayer's own token layout): vLLM's prefix-cache hit and a
kvlayer CPU-tier hit (vLLM's prefix caching off) at each length, through ``kvlayer bench vllm``'s
runner, one engine each. A row passes when kvlayer loaded the whole-chunk prefix, its greedy
token equals recompute's, and its hit is within ``GOAL`` of vLLM's own. Without vLLM: one row
saying so (the check still passes).
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from typing import Any

GOAL = 1.25


def vllm_rows(model: str, vocab: int, args: argparse.Namespace, row: Any) -> list[Any]:
    """The rows (``row`` is gpu_check's ``Row``) for ``args.lengths`` and ``args.chunk_size``;
    ``vocab``: the model's vocabulary size (for the prompts)."""
    if importlib.util.find_spec("vllm") is None:
        return [row("vllm", "vLLM not installed", None, note="pip install vllm to check the connector on CUDA")]
    from kvlayer.benchmarks.vllm_bench import config_spec, run_config

    bench = argparse.Namespace(lengths=list(args.lengths), suffix=args.suffix, repeat=2, chunk_size=args.chunk_size,
                               block_size=16, dtype="bfloat16")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvlayer-gpu-vllm-") as folder:
        for name in ("recompute", "prefix-cache", "cpu"):
            results[name] = run_config(config_spec(name, bench, model, vocab, folder, None), folder, lambda n=1: None)
    errors = [f"{n}: {r['error']}" for n, r in results.items() if r.get("error")]
    if errors:
        return [row("vllm", "engine start", None, passed=False, note="; ".join(errors)[:200])]
    rows = []
    by = {n: {r["length"]: r for r in res["rows"]} for n, res in results.items()}
    for n in args.lengths:
        own, ours, cold = by["prefix-cache"][n], by["cpu"][n], by["recompute"][n]
        cached = (n + args.suffix - 1) // args.chunk_size * args.chunk_size
        same = ours["tokens"] == cold["tokens"]
        rows.append(row("vllm", f"{n} tok kvlayer cpu hit", ours["hit_s"], own["hit_s"], "s",
                        ours["hit_s"] / own["hit_s"], ours["cached"] >= min(cached, n) and same
                        and ours["hit_s"] <= GOAL * own["hit_s"],
                        f"vs vLLM's prefix-cache hit; cached {ours['cached']}; "
                        f"tokens {'=' if same else '!='} recompute's"))
    return rows
