"""``kvlayer bench ttft``: time to first token of a prompt whose prefix kvlayer holds.

For each prefix length L (the prompt is L cached tokens + a short new suffix), in one run:
``cold`` (kvlayer off, engine prefix cache off: full recompute), the first kvlayer request
(an all-miss: it computes and stores, showing kvlayer's overhead on misses), the hit from
each tier, and each hit's *floor*: KV bytes over the memcpy bandwidth measured in this run
plus the time to compute the suffix alone (measured as an engine prefix-cache hit).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from typing import Any

from kvlayer.benchmarks.common import default_model, machine_info, parse_ints, print_table, write_json

TIER_CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": {"cpu_capacity": "2GiB"},
    "gpu": {"gpu_capacity": "2GiB", "cpu_capacity": 0},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,2048,8192", help="cached prefix lengths")
    p.add_argument("--suffix", type=int, default=32, help="new tokens after the cached prefix")
    p.add_argument("--tiers", default="cpu,gpu", help=f"tiers to measure, of {sorted(TIER_CONFIGS)}")
    p.add_argument("--chunk-size", type=int, default=256)


def memcpy_bandwidth(nbytes: int) -> float:
    """Bytes/s of a torch copy into already-touched memory (best of 5)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def ttft(llm, prompt: list[int]) -> float:
    from kvlayer.engine import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))[0]
    return out.metrics.ttft


def make_llm(model: str, device: str, max_len: int, kv_config: dict | None, prefix_caching: bool = False):
    from kvlayer.engine import LLM

    return LLM(model, device=device, enable_prefix_caching=prefix_caching, kv_cache_memory="1GiB",
               max_num_batched_tokens=max_len, kv_config=kv_config)


def main(args: argparse.Namespace) -> int:
    model = args.model or default_model(args.home, "bench")
    lengths = parse_ints(args.lengths)
    tiers = [t for t in args.tiers.split(",") if t]
    for t in tiers:
        if t not in TIER_CONFIGS:
            raise ValueError(f"unknown tier {t!r}; choose from {sorted(TIER_CONFIGS)}")
    max_len = max(lengths) + args.suffix
    workdir = tempfile.mkdtemp(prefix="kvlayer-ttft-")
    try:
        return _run(args, model, lengths, tiers, max_len, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args, model, lengths, tiers, max_len, workdir) -> int:
    cold = make_llm(model, args.device, max_len, None)
    engine = make_llm(model, args.device, max_len, None, prefix_caching=True)
    kv = {t: make_llm(model, args.device, max_len,
                      {"chunk_size": args.chunk_size, **TIER_CONFIGS[t]}) for t in tiers}
    vocab = cold.engine.model_config.vocab_size
    per_token = kv[tiers[0]].engine.connector.engine.layout.bytes_per_token if tiers else 0
    warm = [random.Random(-1).randrange(3, vocab) for _ in range(64)]
    for llm in (cold, engine, *kv.values()):
        ttft(llm, warm)
    bandwidth = memcpy_bandwidth(max(lengths) * per_token) if per_token else 0.0
    rows, results = [], []
    for n in lengths:
        rng = random.Random(n)
        prompt = [rng.randrange(3, vocab) for _ in range(n + args.suffix)]
        t_cold = ttft(cold, prompt)
        ttft(engine, prompt)
        t_suffix = ttft(engine, prompt)
        cached = n // args.chunk_size * args.chunk_size
        floor = cached * per_token / bandwidth + t_suffix if bandwidth else None
        res: dict[str, Any] = {"prefix": n, "cold_s": t_cold, "suffix_s": t_suffix, "floor_s": floor,
                               "kv_bytes": cached * per_token, "tiers": {}}
        row = [n, t_cold]
        for t in tiers:
            t_miss = ttft(kv[t], prompt)
            t_hit = ttft(kv[t], prompt)
            res["tiers"][t] = {"miss_s": t_miss, "hit_s": t_hit, "speedup": t_cold / t_hit,
                               "hit_over_floor": t_hit / floor if floor else None,
                               "miss_overhead": t_miss / t_cold - 1}
            row += [t_hit, t_cold / t_hit, t_hit / floor if floor else None, 100 * (t_miss / t_cold - 1)]
        row.append(floor)
        rows.append(row)
        results.append(res)
    cols = ["prefix", "cold s"]
    for t in tiers:
        cols += [f"{t} hit s", f"{t} speedup", f"{t} hit/floor", f"{t} miss +%"]
    cols.append("floor s")
    print_table(f"bench ttft: {model} (memcpy {bandwidth / 2**30:.1f} GiB/s)", cols, rows)
    for llm in (cold, engine, *kv.values()):
        llm.close()
    write_json(args.json, {"machine": machine_info(args.device), "model": model, "suffix": args.suffix,
                           "chunk_size": args.chunk_size, "memcpy_gib_s": bandwidth / 2**30,
                           "results": results})
    return 0
