"""``kvlayer bench vllm --itl``: the inter-token latency of running decode streams while one
request loads a long prefix from NVMe or Redis, with kvlayer's loads synchronous or async.

    kvlayer bench vllm --itl --lengths 8064 --json itl.json

Per tier (NVMe, Redis; no CPU tier) two vLLM engines run one after another, ``async_loads`` off
then on, on the same random-weight model, the tier's chunks shared (the NVMe folder, the Redis
server): the first engine stores the prefix (one miss), the second finds it. In each engine
``--streams`` requests decode; for 16 tokens nothing else runs (``quiet``), then a request of
the prefix and a fresh suffix arrives and its prefix is loaded from the tier (``load``: the
streams' token gaps from its arrival until its first token). Reported: each engine's mean gap,
quiet and while loading, their ratio (goal: within 1.2x), the same over the gaps before the step
that computes the request (``transfer``: only the load runs; that step, the request's suffix
over its prefix, follows a hit of vLLM's own prefix cache too), the longest gap, and the
loading request's TTFT. Each engine runs in a process of its own (``python -m kvlayer.benchmarks.vllm_itl
SPEC.json``); vLLM is imported there only.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QUIET_TOKENS = 16


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="KVLayerConnectorV1", kv_role="kv_both",
                                kv_connector_module_path="kvlayer.connectors.vllm_v1",
                                kv_connector_extra_config=spec["extra"])
    return LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               max_model_len=spec["max_model_len"], block_size=128, enable_prefix_caching=False, seed=0,
               kv_transfer_config=transfer)


def _gaps(times: list[float], lo: float, hi: float) -> list[float]:
    """The gaps between consecutive token times that end within ``(lo, hi]``."""
    return [b - a for a, b in zip(times, times[1:]) if lo < b <= hi]


def measure(llm: Any, streams: list[list[int]], prompt: list[int]) -> dict[str, Any]:
    """Decode ``streams``, quiet for ``QUIET_TOKENS`` tokens, then add ``prompt`` (1 token): the
    streams' gaps quiet and until ``prompt``'s first token, and ``prompt``'s TTFT."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    decode = SamplingParams(max_tokens=4096, temperature=0, detokenize=False, ignore_eos=True)
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(len(streams))}
    for i, p in enumerate(streams):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, decode)

    stamp = [0.0]

    def step() -> list[Any]:
        outs = engine.step()
        now = stamp[0] = time.perf_counter()
        for o in outs:
            if o.request_id in times:
                times[o.request_id] += [now] * (len(o.outputs[0].token_ids) - len(times[o.request_id]))
        return outs

    while min(len(t) for t in times.values()) < 2:  # every stream decoding
        step()
    quiet_from = time.perf_counter()
    while min(len(t) for t in times.values()) < 2 + QUIET_TOKENS:
        step()
    added = time.perf_counter()
    engine.add_request("load", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, temperature=0, detokenize=False))
    first, cached, token = None, 0, -1
    while first is None:
        for o in step():
            if o.request_id == "load" and o.outputs[0].token_ids:
                first, cached, token = time.perf_counter(), int(o.num_cached_tokens or 0), o.outputs[0].token_ids[0]
    engine.abort_request(list(times))
    quiet = [g for t in times.values() for g in _gaps(t, quiet_from, added)]
    loading = [g for t in times.values() for g in _gaps(t, added, first)]
    # the gaps before the step that computes the request (its suffix over the loaded prefix, as
    # after a hit of vLLM's own): the streams' pace while only the transfer runs (async loads)
    transfer = [g for t in times.values() for g in _gaps(t, added, stamp[0] - 1e-9)]
    return {"quiet_gap_s": statistics.mean(quiet), "load_gap_s": statistics.mean(loading) if loading else 0.0,
            "load_max_gap_s": max(loading, default=0.0), "load_gaps": len(loading), "ttft_s": first - added,
            "transfer_gap_s": statistics.mean(transfer) if transfer else 0.0, "transfer_gaps": len(transfer),
            "cached": cached, "token": int(token)}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: store the prefix if ``store``, then ``measure``."""
    from vllm import SamplingParams

    from kvlayer.benchmarks.vllm_runner import in_process_worker

    llm = _engine(spec)
    rng = random.Random(spec["length"])
    vocab = spec["vocab"]
    prefix = [rng.randrange(3, vocab) for _ in range(spec["length"])]
    suffixes = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(2)]
    streams = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(spec["streams"])]
    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    llm.generate([{"prompt_token_ids": [5] * 16}], one, use_tqdm=False)  # warm-up
    if spec["store"]:
        llm.generate([{"prompt_token_ids": prefix + suffixes[0]}], one, use_tqdm=False)
        worker = in_process_worker()
        if worker is not None:
            worker.kv.flush()
    out = measure(llm, streams, prefix + suffixes[1])
    worker = in_process_worker()
    out["async_loads"] = worker.totals["async_loads"] if worker is not None else -1
    return out


def _child(spec: dict[str, Any], folder: str) -> dict[str, Any]:
    path = Path(folder) / f"itl-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "kvlayer.benchmarks.vllm_itl", str(path)], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def main(args: Any, model: str, vocab: int) -> int:
    """``kvlayer bench vllm --itl``: every tier, sync then async, at the first of ``--lengths``,
    on ``model`` (a folder) of ``vocab`` tokens."""
    from kvlayer.benchmarks.redis_local import LocalRedis

    redis = LocalRedis() if LocalRedis.available() else None
    if redis is None:
        raise ValueError("kvlayer bench vllm --itl needs redis-server")
    length = args.lengths[0]
    record: dict[str, Any] = {"length": length, "streams": 4, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="kvlayer-itl-", dir=args.home) as folder, redis as server:
        tiers = {"nvme": {"nvme_path": f"{folder}/nvme", "nvme_capacity": "8GiB"}, "redis": {"redis_url": server.url}}
        for name, tier in tiers.items():
            for mode in ("sync", "async"):
                extra = {"cpu_capacity": 0, "chunk_size": args.chunk_size, "async_loads": mode == "async", **tier}
                spec = {"model": model, "extra": extra, "length": length, "vocab": vocab, "streams": 4,
                        "max_model_len": length + 64, "store": mode == "sync"}
                got = record["runs"][f"{name}-{mode}"] = _child(spec, folder)
                print(f"{name}-{mode}: {json.dumps(got)}", flush=True)
    report(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if all("error" not in r for r in record["runs"].values()) else 1


def report(record: dict[str, Any]) -> None:
    """The table of ``main``'s runs."""
    print(f"{record['length']}-token prefix, {record['streams']} decode streams")
    print("run          quiet gap s  gap while loading s  ratio  transfer gap s  ratio  max gap s  load TTFT s  cached")
    for name, r in record["runs"].items():
        if "error" in r:
            print(f"{name:12} error")
            continue
        quiet = r["quiet_gap_s"] or float("nan")
        moving = f"{r['transfer_gap_s']:14.4f}  {r['transfer_gap_s'] / quiet:5.2f}" if r.get("transfer_gaps") else \
            f"{'-':>14}  {'-':>5}"  # a sync load runs within the request's own step
        print(f"{name:12} {r['quiet_gap_s']:11.4f}  {r['load_gap_s']:19.4f}  {r['load_gap_s'] / quiet:5.2f}  {moving}"
              f"  {r['load_max_gap_s']:9.3f}  {r['ttft_s']:11.3f}  {r['cached']}")


if __name__ == "__main__":
    result = run(json.loads(Path(sys.argv[1]).read_text()))
    print(json.dumps(result), flush=True)
    os._exit(0)
