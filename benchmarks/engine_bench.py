"""``kvlayer bench engine``: the bundled engine's prefill and decode speed next to transformers'.

Same weights, same run: prefill tokens/s per prompt length (ours: one engine step; theirs:
one forward, logits of the last position only) and decode tokens/s (ours: N sequences
batched; theirs: one sequence at a time with ``generate``).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from kvlayer.benchmarks.common import default_model, machine_info, parse_ints, print_table, timed, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="512,2048,8192", help="prompt lengths for prefill")
    p.add_argument("--decode-seqs", type=int, default=16)
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip transformers (not installed, or to save time)")


def ours_prefill(llm, length: int, vocab: int) -> float:
    from kvlayer.engine import SamplingParams

    eng = llm.engine
    ids = [random.Random(length).randrange(3, vocab) for _ in range(length)]
    eng.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def ours_decode(llm, seqs: int, prompt: int, tokens: int, vocab: int) -> float:
    """Decode tokens/s of ``seqs`` sequences batched (steps that only decode)."""
    from kvlayer.engine import SamplingParams

    eng = llm.engine
    rng = random.Random(1)
    for _ in range(seqs):
        eng.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt)]},
                        SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    elapsed, generated = 0.0, 0
    while eng.has_unfinished_requests():
        plan_is_decode = all(s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running) \
            and not eng.scheduler.waiting
        dt, outs = timed(eng.step)
        if plan_is_decode:
            elapsed += dt
            generated += len(outs)
    return generated / elapsed


def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def hf_prefill(model, length: int, vocab: int) -> float:
    import torch

    ids = torch.tensor([[random.Random(length).randrange(3, vocab) for _ in range(length)]])
    with torch.inference_mode():
        t = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t


def hf_decode(model, prompt: int, tokens: int, vocab: int) -> float:
    import torch

    ids = torch.tensor([[random.Random(1).randrange(3, vocab) for _ in range(prompt)]])
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0)
        return tokens / (time.perf_counter() - t)


def main(args: argparse.Namespace) -> int:
    from kvlayer.engine import LLM

    model = args.model or default_model(args.home, "bench")
    lengths = parse_ints(args.lengths)
    llm = LLM(model, device=args.device, enable_prefix_caching=False, kv_cache_memory="4GiB",
              max_num_batched_tokens=max(lengths + [args.decode_seqs * args.decode_prompt]))
    vocab = llm.engine.model_config.vocab_size
    ours_prefill(llm, 64, vocab)  # warm-up
    hf = None if args.no_hf else hf_model(model)
    if hf is not None:
        hf_prefill(hf, 64, vocab)
    rows, results = [], {"prefill": [], "decode": {}}
    for n in lengths:
        ours = ours_prefill(llm, n, vocab)
        theirs = hf_prefill(hf, n, vocab) if hf is not None else None
        ratio = theirs / ours if theirs else None
        rows.append([f"prefill {n}", n / ours, n / theirs if theirs else None, ratio])
        results["prefill"].append({"tokens": n, "ours_s": ours, "hf_s": theirs, "ratio": ratio})
    ours_tps = ours_decode(llm, args.decode_seqs, args.decode_prompt, args.decode_tokens, vocab)
    hf_tps = hf_decode(hf, args.decode_prompt, args.decode_tokens, vocab) if hf is not None else None
    ratio = ours_tps / hf_tps if hf_tps else None
    rows.append([f"decode ({args.decode_seqs} seqs vs 1)", ours_tps, hf_tps, ratio])
    results["decode"] = {"seqs": args.decode_seqs, "ours_tok_s": ours_tps, "hf_tok_s": hf_tps, "ratio": ratio}
    print_table(f"bench engine: {model}", ["case", "ours tok/s", "transformers tok/s", "ratio"], rows)
    payload: dict[str, Any] = {"machine": machine_info(args.device), "model": model, **results}
    write_json(args.json, payload)
    return 0
