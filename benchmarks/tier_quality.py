"""The quantized-storage rows of ``kvlayer bench tiers``: what hits from quantized NVMe chunks cost
in accuracy and gain in bytes and TTFT, against exact storage, through the bundled engine.

``measure_quality`` runs ``prompts`` (each ``chunks`` full chunks and a few more tokens) greedily
through a reference ``LLM`` without kvlayer, then, per ``storage_quantization`` value (``none``
is exact storage), through an ``LLM`` whose only tier is NVMe: a first pass computes and stores
every prompt's chunks, a second one (page cache dropped first) loads them. Engine prefix cache
off, so every hit comes from kvlayer. Per value it reports the bytes stored per token (files
over tokens), the median TTFT of the first and the second pass, and the second pass against
the reference (``compare``): greedy-token agreement (the tokens generated before the first
difference, over all generated) and the largest logit difference, over the steps whose
context still equals the reference's.

The engine does not hand out logits, so ``generate`` records those of its model runner's steps
(one request at a time: one row per step).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlayer.benchmarks.common import default_model, print_table
from kvlayer.benchmarks.tier_ceilings import drop_page_cache


@dataclass(frozen=True, slots=True)
class Generation:
    """One greedy request: its generated tokens, the logits each came from (float32
    ``[tokens, vocab]``), its TTFT (s) and how many prompt tokens kvlayer supplied."""

    tokens: tuple[int, ...]
    logits: torch.Tensor
    ttft_s: float
    external_tokens: int


@dataclass(frozen=True, slots=True)
class Agreement:
    """``compare``'s answer: generated tokens before the first difference over all generated
    (``agreement``), prompts whose tokens were all equal (``identical``) of ``prompts``, and the
    largest absolute logit difference where the context was still the same (``max_logit_diff``)."""

    agreement: float
    identical: int
    prompts: int
    max_logit_diff: float


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
    """Each prompt alone through ``llm`` (a ``kvlayer.engine.LLM``), greedily, exactly ``max_tokens``
    tokens, with the logits of each step."""
    from kvlayer.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runner = llm.engine.runner
    execute = runner.execute
    steps: list[torch.Tensor] = []

    def recording(plan: Any, hooks: Any = None) -> torch.Tensor:
        logits = execute(plan, hooks)
        steps.append(logits.detach().to("cpu", copy=True))
        return logits

    runner.execute = recording
    out = []
    try:
        for prompt in prompts:
            steps.clear()
            done = llm.generate([{"prompt_token_ids": list(prompt)}], params)[0]
            out.append(Generation(done.outputs[0].token_ids, torch.cat(steps), float(done.metrics.ttft or 0.0),
                                  done.num_external_tokens))
    finally:
        runner.execute = execute
    return out


def compare(reference: Sequence[Generation], got: Sequence[Generation]) -> Agreement:
    """How far ``got`` is from ``reference`` (the same prompts, in order): see ``Agreement``."""
    agreed = total = identical = 0
    worst = 0.0
    for ref, g in zip(reference, got, strict=True):
        same = 0
        while same < min(len(ref.tokens), len(g.tokens)) and ref.tokens[same] == g.tokens[same]:
            same += 1
        # step same's logits still come from the reference's context; later ones do not
        steps = min(same + 1, len(ref.tokens), len(g.tokens))
        worst = max(worst, float((ref.logits[:steps] - g.logits[:steps]).abs().max()))
        agreed += same
        total += len(ref.tokens)
        identical += ref.tokens == g.tokens
    return Agreement(agreed / total if total else 1.0, identical, len(reference), worst)


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` random prompts of ``length`` tokens (no two share a first chunk)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def measure_quality(model: str, quantizations: Sequence[str], folder: str, chunk_size: int, prompts: int,
                    max_tokens: int, chunks: int = 2) -> dict[str, Any]:
    """The quality rows (see the module docstring) for the model folder ``model``; NVMe files go
    to fresh folders under ``folder``. RuntimeError if a second pass hit nothing."""
    from kvlayer.engine import LLM
    from kvlayer.engine.model_config import load_model_config

    length = chunks * chunk_size + 4
    texts = make_prompts(prompts, length, load_model_config(model).vocab_size)
    blocks = 2 * -(-(length + max_tokens) // 16) + 2
    with LLM(model, num_gpu_blocks=blocks, enable_prefix_caching=False) as llm:
        reference = generate(llm, texts, max_tokens)
    rows = [_row(model, q, Path(folder) / f"quality-{q}", chunk_size, blocks, texts, max_tokens, reference)
            for q in quantizations]
    return {"prompts": prompts, "prompt_tokens": length, "generated_tokens": max_tokens, "chunk_size": chunk_size,
            "rows": rows}


def _row(model: str, quantization: str, root: Path, chunk_size: int, blocks: int, texts: list[list[int]],
         max_tokens: int, reference: list[Generation]) -> dict[str, Any]:
    from kvlayer.engine import LLM

    kv = {"chunk_size": chunk_size, "cpu_capacity": 0, "nvme_path": str(root), "storage_quantization": quantization}
    with LLM(model, num_gpu_blocks=blocks, enable_prefix_caching=False, kv_config=kv) as llm:
        generate(llm, [[5] * max(1, chunk_size - 1)], 1)  # warm-up, untimed: shorter than a chunk, stores nothing
        first = generate(llm, texts, max_tokens)
        llm.engine.connector.kv.flush()
        files = [str(p) for p in root.rglob("*.kvc")]
        drop_page_cache(files)
        second = generate(llm, texts, max_tokens)
    stored = sum(Path(f).stat().st_size for f in files)
    hits = sum(g.external_tokens for g in second)
    if not hits:
        raise RuntimeError(f"storage_quantization {quantization}: the second pass hit nothing")
    acc = compare(reference, second)
    return {"quantization": quantization, "files": len(files),
            "stored_bytes_per_token": stored / (len(files) * chunk_size),
            "miss_ttft_s": statistics.median(g.ttft_s for g in first),
            "hit_ttft_s": statistics.median(g.ttft_s for g in second), "hit_tokens": hits,
            "agreement": acc.agreement, "identical": acc.identical, "max_logit_diff": acc.max_logit_diff}


def quality_rows(args: argparse.Namespace, quantizations: Sequence[str], folder: str,
                 chunk_tokens: int) -> dict[str, Any] | None:
    """``kvlayer bench tiers``' quality rows: ``measure_quality`` of the lossy ``quantizations`` and
    exact storage, for ``args.preset``'s model (None without a lossy one or ``--quality-prompts``)."""
    lossy = [q for q in quantizations if q != "none"]
    if not lossy or not args.quality_prompts:
        return None
    return measure_quality(default_model(args.home, args.preset), ["none", *lossy], folder, chunk_tokens,
                           args.quality_prompts, args.quality_tokens)


def print_quality(quality: dict[str, Any] | None) -> None:
    """Print the quality rows as a table (nothing for None)."""
    if quality is None:
        return
    rows = quality["rows"]
    exact = next((r for r in rows if r["quantization"] == "none"), None)
    table = [[r["quantization"], r["stored_bytes_per_token"], 1e3 * r["miss_ttft_s"], 1e3 * r["hit_ttft_s"],
              r["hit_ttft_s"] / exact["hit_ttft_s"] if exact else None, f"{100 * r['agreement']:.1f}%",
              f"{r['identical']}/{quality['prompts']}", r["max_logit_diff"]] for r in rows]
    print_table(f"bench tiers: NVMe hits with storage_quantization, {quality['prompts']} prompts of "
                f"{quality['prompt_tokens']} tokens ({quality['chunk_size']}-token chunks), "
                f"{quality['generated_tokens']} greedy tokens each, against the same model without kvlayer",
                ["quant", "B/tok", "miss TTFT ms", "hit TTFT ms", "hit/exact", "agreement", "identical",
                 "max |dlogit|"], table)
    print("agreement: generated tokens before the first difference from the reference, over all generated; "
          "max |dlogit|: over the steps whose context is still the reference's")
