"""``kvlayer demo``: a multi-turn chat through the bundled engine, with and without kvlayer.

Each turn's prompt is a long system prompt, the conversation so far and a new user message.
Three configurations run side by side: ``recompute`` (no prefix cache), ``engine`` (the
engine's own prefix cache) and ``kvlayer`` (engine prefix cache off: every earlier turn
comes back from kvlayer's CPU + disk tiers). Prints per-turn TTFT and decode tokens/s.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from kvlayer.benchmarks.common import default_model, print_table


def chat(llm, system: list[int], turns: int, vocab: int, answer_tokens: int = 32) -> list[tuple[float, float]]:
    """Run the chat; per turn (TTFT seconds, decode tokens/s)."""
    from kvlayer.engine import SamplingParams

    rng = random.Random(7)
    history = list(system)
    out = []
    for _ in range(turns):
        history += [rng.randrange(3, vocab) for _ in range(64)]
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": history}],
                           SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True))[0]
        m = res.metrics
        decode_s = max(m.finish_time - m.first_token_time, 1e-9)
        out.append((m.first_token_time - t, (len(res.outputs[0].token_ids) - 1) / decode_s))
        history += list(res.outputs[0].token_ids)
    return out


def run_demo(args: argparse.Namespace) -> int:
    from kvlayer.engine import LLM

    model = args.model or default_model(args.home, "bench")
    cache = Path(args.home) / "cache"
    kv_config = args.kv_config or {"chunk_size": 256, "cpu_capacity": "1GiB", "nvme_path": str(cache),
                                   "nvme_capacity": "8GiB"}
    configs = {
        "recompute": dict(enable_prefix_caching=False),
        "engine": dict(enable_prefix_caching=True),
        "kvlayer": dict(enable_prefix_caching=False, kv_config=kv_config),
    }
    results = {}
    for name, kw in configs.items():
        llm = LLM(model, device=args.device, kv_cache_memory="1GiB", **kw)
        vocab = llm.engine.model_config.vocab_size
        system = [random.Random(0).randrange(3, vocab) for _ in range(1536)]
        print(f"running {name} ...", flush=True)
        results[name] = chat(llm, system, args.turns, vocab)
        llm.close()
    rows = []
    for turn in range(args.turns):
        row: list = [turn + 1]
        for name in configs:
            row += [results[name][turn][0], results[name][turn][1]]
        rows.append(row)
    cols = ["turn"]
    for name in configs:
        cols += [f"{name} TTFT s", f"{name} tok/s"]
    print_table(f"multi-turn chat on {model} ({args.device})", cols, rows)
    return 0
