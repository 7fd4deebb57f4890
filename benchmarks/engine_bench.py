"""``kvlayer bench engine``: the bundled engine's prefill and decode speed next to transformers'.

Same weights, device and dtype, same run: prefill tokens/s per prompt length (ours: one engine step; theirs:
one forward, logits of the last position only) and decode tokens/s (ours: N sequences
batched; theirs: one sequence at a time with ``generate``). The engine's KV cache is sized to
the largest case, which the timings do not depend on.

Example: ``kvlayer bench engine --lengths 512,2048 --json engine.json --plot engine.png``
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    positive_ints,
    print_table,
    progress,
    save_figure,
    settings_of,
    timed,
    write_json,
)
from kvlayer.benchmarks.workloads import random_tokens

BLOCK_SIZE = 16
WARMUP_TOKENS = 64
"""Prompt length of the untimed first prefill of each implementation."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench engine``."""
    p.add_argument("--lengths", type=positive_ints, default="512,2048,8192", help="prompt lengths for prefill")
    p.add_argument("--decode-seqs", type=positive_int, default=16)
    p.add_argument("--decode-prompt", type=positive_int, default=128)
    p.add_argument("--decode-tokens", type=positive_int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip transformers (not installed, or to save time)")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="prefill measurements per length, ours and transformers' alternating; medians reported")
    add_plot_argument(p)


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return random_tokens(random.Random(seed), length, vocab)


def ours_prefill(llm: Any, length: int, vocab: int) -> float:
    """Seconds the engine of ``llm`` takes to prefill one ``length``-token prompt (one output token)."""
    from kvlayer.engine import SamplingParams

    eng = llm.engine
    eng.add_request({"prompt_token_ids": _prompt(length, length, vocab)}, SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def ours_decode(llm: Any, seqs: int, prompt: int, tokens: int, vocab: int) -> float:
    """Decode tokens/s of ``seqs`` sequences batched (steps that only decode)."""
    from kvlayer.engine import SamplingParams

    eng = llm.engine
    rng = random.Random(1)
    for _ in range(seqs):
        eng.add_request({"prompt_token_ids": random_tokens(rng, prompt, vocab)},
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


def hf_model(path: str, device: str = "cpu", dtype: str = "float32") -> Any:
    """The transformers model of the folder ``path`` on ``device`` in ``dtype`` (ours' device and
    dtype, so the comparison is like for like), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def _synced(model: Any) -> None:
    """Wait for the model's device to finish its queued work (CUDA runs kernels asynchronously)."""
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def hf_prefill(model: Any, length: int, vocab: int) -> float:
    """Seconds one transformers forward over a ``length``-token prompt takes (last logits only)."""
    import torch

    ids = torch.tensor([_prompt(length, length, vocab)], device=model.device)
    with torch.inference_mode():
        _synced(model)
        t = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        _synced(model)
        return time.perf_counter() - t


def hf_decode(model: Any, prompt: int, tokens: int, vocab: int) -> float:
    """Tokens/s of transformers' ``generate`` of ``tokens`` tokens after a ``prompt``-token prompt
    (its prefill included)."""
    import torch

    ids = torch.tensor([_prompt(1, prompt, vocab)], device=model.device)
    with torch.inference_mode():
        _synced(model)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0)
        _synced(model)
        return tokens / (time.perf_counter() - t)


def kv_blocks(lengths: list[int], seqs: int, prompt: int, tokens: int) -> int:
    """KV blocks for the largest case: the longest prefill (or the warm-up), or every decode
    sequence at its full length; one spare block each."""
    prefill = -(-(max([*lengths, WARMUP_TOKENS]) + 1) // BLOCK_SIZE) + 1
    decode = seqs * (-(-(prompt + tokens) // BLOCK_SIZE) + 1)
    return max(prefill, decode)


def main(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``--json`` and ``--plot``; 0 on success (the flags are
    checked while parsed, see ``add_arguments``)."""
    from kvlayer.engine import LLM

    lengths = args.lengths
    model = args.model or default_model(args.home, "bench")
    facts = model_facts(model, args.device)
    vocab = facts["vocab"]
    with progress(len(lengths) + 1, "bench engine") as advance:
        llm = LLM(model, device=args.device, dtype=facts["dtype"], enable_prefix_caching=False, block_size=BLOCK_SIZE,
                  num_gpu_blocks=kv_blocks(lengths, args.decode_seqs, args.decode_prompt, args.decode_tokens),
                  max_num_batched_tokens=max([*lengths, WARMUP_TOKENS, args.decode_seqs * args.decode_prompt]))
        hf = None if args.no_hf else hf_model(model, args.device, facts["dtype"])
        results = measure(llm, hf, lengths, args, vocab, advance)
    record = {"bench": "engine", "machine": machine_info(args.device), "model": facts,
              "settings": settings_of(args), **results}
    report(record)
    write_json(args.json, record)
    plot(args.plot, record)
    return 0


def measure(llm: Any, hf: Any | None, lengths: list[int], args: argparse.Namespace, vocab: int,
            advance: Callable[[], None]) -> dict[str, Any]:
    """Prefill per length (medians of ``args.repeat`` alternating runs) and batched decode, ours
    and (when ``hf`` is given) transformers'.
    ``ratio`` is ours over theirs in tokens/s (None without transformers); ``preemptions`` (the
    engine's, 0 when its KV cache held every case) would mean a decode figure with recomputes in it."""
    ours_prefill(llm, WARMUP_TOKENS, vocab)
    if hf is not None:
        hf_prefill(hf, WARMUP_TOKENS, vocab)
    prefill = []
    for n in lengths:
        ours_runs: list[float] = []
        hf_runs: list[float] = []
        for _ in range(args.repeat):  # alternating, so both sides see the same machine load
            ours_runs.append(ours_prefill(llm, n, vocab))
            if hf is not None:
                hf_runs.append(hf_prefill(hf, n, vocab))
        ours = statistics.median(ours_runs)
        theirs = statistics.median(hf_runs) if hf_runs else None
        prefill.append({"tokens": n, "ours_s": ours, "hf_s": theirs, "ratio": theirs / ours if theirs else None,
                        "ours_runs_s": ours_runs, "hf_runs_s": hf_runs})
        advance()
    ours_tps = ours_decode(llm, args.decode_seqs, args.decode_prompt, args.decode_tokens, vocab)
    hf_tps = hf_decode(hf, args.decode_prompt, args.decode_tokens, vocab) if hf is not None else None
    advance()
    return {"prefill": prefill, "decode": {"seqs": args.decode_seqs, "ours_tok_s": ours_tps, "hf_tok_s": hf_tps,
                                           "ratio": ours_tps / hf_tps if hf_tps else None,
                                           "preemptions": llm.engine.scheduler.num_preemptions}}


def cases(record: dict[str, Any]) -> list[tuple[str, float, float | None, float | None]]:
    """(case, ours tok/s, transformers tok/s or None, ratio or None) per prefill length, then decode."""
    out = [(f"prefill {p['tokens']}", p["tokens"] / p["ours_s"], p["tokens"] / p["hf_s"] if p["hf_s"] else None,
            p["ratio"]) for p in record["prefill"]]
    d = record["decode"]
    out.append((f"decode ({d['seqs']} seqs vs 1)", d["ours_tok_s"], d["hf_tok_s"], d["ratio"]))
    return out


def report(record: dict[str, Any]) -> None:
    """Print the table of tokens/s per case and what the ratio means."""
    m = record["model"]
    print_table(f"bench engine: {m['name']} ({m['layers']} layers, {m['dtype']})",
                ["case", "ours tok/s", "transformers tok/s", "ratio"], [list(c) for c in cases(record)])
    print("ratio = ours / transformers in tokens/s; decode: ours batched, transformers one sequence at a time")


def plot(path: str | None, record: dict[str, Any]) -> None:
    """Bars of tokens/s per case (log scale: prefill and decode differ tenfold), ours next to
    transformers, each pair's ratio written above it."""
    if not path:
        return
    rows = cases(record)
    fig, axes = new_figure(1, 1, (max(9.0, 1.6 * len(rows) + 3), 4.8))
    ax = axes[0][0]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="kvlayer engine")
    if not record["settings"]["no_hf"]:
        ax.bar([i + 0.2 for i in x], [r[2] or float("nan") for r in rows], 0.4, color="tab:gray",
               label="transformers")
    for i, r in enumerate(rows):
        if r[3] is not None:
            ax.annotate(f"{r[3]:.2f}x", (i, max(r[1], r[2] or 0.0)), xytext=(0, 3), textcoords="offset points",
                        ha="center", fontsize=8)
    ax.set_xticks(list(x), [r[0] for r in rows], fontsize=8)
    ax.set(ylabel="tokens/s", yscale="log", title="bench engine: tokens/s (ratio = ours / transformers)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8)
    st = record["settings"]
    setup = (f"decode: {st['decode_seqs']} sequences batched vs transformers one at a time, "
             f"{st['decode_prompt']}-token prompts, {st['decode_tokens']} tokens each; "
             + ("transformers skipped (--no-hf)" if st["no_hf"]
                else f"transformers: {record['model']['dtype']} on {st['device']}, as ours"))
    save_figure(fig, path, record, setup)
    close_figure(fig)
