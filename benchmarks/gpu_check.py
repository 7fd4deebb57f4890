"""``python -m kvlayer.benchmarks.gpu_check --out gpu_check.json``: kvlayer's check on one CUDA GPU.

1. Every Triton kernel against its torch reference on random inputs (gather/scatter, one layer
   and all layers, to and from pinned host chunks; decode attention, direct and through the
   engine's ``paged_attention``).
2. Bandwidth: gather/scatter against a device-to-device ``copy_`` of the same bytes, and chunk
   GPU<->pinned-CPU transfers against a plain pinned ``copy_`` of the same bytes (goal: 80%).
3. TTFT of a ~1B-parameter random Llama at 8k and 32k tokens: cold recompute against a hit
   from kvlayer's CPU tier and from its GPU tier, through ``kvlayer.engine.LLM``; then, where
   vLLM's CUDA build is installed, kvlayer's connector inside vLLM (``gpu_check_vllm``).

Prints one table and writes its rows as JSON to ``--out``. Exit status: 0 when every row
passes, 1 when one fails, 2 without CUDA or triton. About 2-3 minutes on an H200, most of it
writing and loading the model. Without a GPU, ``pytest tests/kernels`` runs the kernels under
Triton's interpreter instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlayer.benchmarks.common import machine_info, positive_int, positive_ints, print_table, write_json
from kvlayer.benchmarks.gpu_check_vllm import vllm_rows

COLUMNS = ("section", "what", "measured", "reference", "unit", "ratio", "pass", "note")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DECODE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
"""Max abs error of decode attention against the float32 torch path (output rounding dominates)."""
MODEL_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 40960,
            "rope_theta": 500000.0}
"""A Llama-3.2-1B-like shape with a smaller vocabulary: ~1.1B parameters, 32 KiB of bf16 KV per token."""


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the report. ``passed`` None: information only."""

    section: str
    what: str
    measured: float | None
    reference: float | None = None
    unit: str = ""
    ratio: float | None = None
    passed: bool | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class CheckSizes:
    """Shapes of the kernel checks (the tests pass tiny ones)."""

    heads_dims: tuple[tuple[int, int], ...] = ((1, 128), (8, 64), (8, 128), (2, 16))
    layers: int = 4
    num_blocks: int = 64
    block_size: int = 16
    tokens: int = 300
    decode_gqa: tuple[tuple[int, int, int], ...] = ((8, 8, 128), (32, 8, 64))  # (heads, kv_heads, head_dim)
    decode_lens: tuple[int, ...] = (1, 16, 17, 1000, 4097)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvlayer.benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--lengths", type=positive_ints, default=[8192, 32768], help="TTFT prompt lengths (cached part)")
    p.add_argument("--suffix", type=positive_int, default=32, help="new tokens after the cached prefix")
    p.add_argument("--chunk-size", type=positive_int, default=256)
    p.add_argument("--bw-tokens", type=positive_ints, default=[256, 8192], help="tokens per bandwidth transfer")
    p.add_argument("--goal", type=float, default=0.8, help="bandwidth goal, a fraction of the plain copy_")
    p.add_argument("--model-dir", help="keep the 1B model here (made once); default: a temporary folder")
    p.add_argument("--no-ttft", action="store_true", help="skip the TTFT comparison")
    args = p.parse_args(argv)
    if max(args.lengths, default=0) + args.suffix >= MODEL_1B["max_position_embeddings"]:
        p.error(f"--lengths + --suffix must stay below {MODEL_1B['max_position_embeddings']} tokens")
    return args


# ----- arithmetic and the report (no GPU needed) ---------------------------------------
def gib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**30


def bandwidth_row(what: str, nbytes: int, seconds: float, ref_seconds: float, goal: float, note: str) -> Row:
    """``what`` moving ``nbytes`` in ``seconds`` against the plain copy's ``ref_seconds``."""
    ratio = ref_seconds / seconds
    return Row("bandwidth", what, gib_per_s(nbytes, seconds), gib_per_s(nbytes, ref_seconds), "GiB/s",
               ratio, ratio >= goal, note)


def check_row(what: str, error: float, tolerance: float, note: str = "") -> Row:
    return Row("check", what, error, tolerance, "max abs err", None, error <= tolerance, note)


def table_rows(rows: Sequence[Row]) -> list[list[Any]]:
    """``rows`` as table cells in ``COLUMNS`` order (pass as "ok", "FAIL" or None)."""
    verdict = {True: "ok", False: "FAIL", None: None}
    return [[r.section, r.what, r.measured, r.reference, r.unit, r.ratio, verdict[r.passed], r.note] for r in rows]


def report(rows: Sequence[Row], args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    return {"machine": machine, "args": vars(args), "passed": all(r.passed is not False for r in rows),
            "rows": [dataclasses.asdict(r) for r in rows]}


def model_1b_config() -> dict[str, Any]:
    """``config.json`` of the 1B model: the "bench" preset's Llama config with ``MODEL_1B``'s shape."""
    from kvlayer.engine.presets import preset_config

    return {**preset_config("bench", dtype="bfloat16"), **MODEL_1B}


def parameter_count(config: dict[str, Any]) -> int:
    from kvlayer.engine.loader import checkpoint_shapes
    from kvlayer.engine.model_config import parse_model_config

    total = 0
    for shape in checkpoint_shapes(parse_model_config(config)).values():
        total += int(torch.Size(shape).numel())
    return total


def write_model_1b(folder: Path, seed: int = 0) -> Path:
    """Write the random 1B model (bf16 weights, no tokenizer) into ``folder`` unless it is there."""
    import json

    from safetensors.torch import save_file

    from kvlayer.engine.model_config import parse_model_config
    from kvlayer.engine.presets import random_weights

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = model_1b_config()
    weights = random_weights(parse_model_config(config, folder.name), seed, torch.bfloat16)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


# ----- 1. kernels against torch --------------------------------------------------------
def kernel_checks(device: torch.device, sizes: CheckSizes = CheckSizes()) -> list[Row]:
    """Rows comparing each Triton path with torch on ``device`` (CUDA, or CPU under the interpreter)."""
    from kvlayer import transfer

    gen = torch.Generator().manual_seed(0)
    worst: dict[str, tuple[float, str]] = {}
    for dtype in DTYPES:
        for heads, dim in sizes.heads_dims:
            case = f"{str(dtype).removeprefix('torch.')} {heads}x{dim}"
            for op, err in _copy_errors(transfer, device, dtype, heads, dim, sizes, gen).items():
                if err >= worst.get(op, (-1.0, ""))[0]:
                    worst[op] = (err, case)
    rows = [check_row(op, err, 0.0, f"worst: {case}") for op, (err, case) in worst.items()]
    return rows + _decode_checks(device, sizes, gen)


def _copy_errors(transfer, device, dtype, heads, dim, sizes, gen) -> dict[str, float]:
    shape = (2, sizes.num_blocks, sizes.block_size, heads, dim)
    caches = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(sizes.layers)]
    total = sizes.num_blocks * sizes.block_size
    reads = torch.randint(0, total, (sizes.tokens,), generator=gen).to(device)  # repeats and any order
    writes = torch.randperm(total, generator=gen)[: sizes.tokens].to(device)
    chunk_shape = (sizes.layers, 2, sizes.tokens, heads, dim)
    chunk = torch.randn(chunk_shape, generator=gen).to(device, dtype)
    hosts = [False, True] if device.type == "cuda" else [False]
    errors = {}
    for host in hosts:
        tag = " (pinned host chunk)" if host else ""

        def buffer(like: torch.Tensor, host: bool = host) -> torch.Tensor:
            return torch.empty(like.shape, dtype=dtype, pin_memory=True) if host else torch.empty_like(like)

        ref, out = torch.empty_like(chunk), buffer(chunk)
        transfer.gather(caches, reads, ref, use_triton=False)
        transfer.gather(caches, reads, out, use_triton=True)
        ref_l, out_l = torch.empty_like(chunk[-1]), buffer(chunk[-1])
        transfer.gather_layer(caches[-1], reads, ref_l, use_triton=False)
        transfer.gather_layer(caches[-1], reads, out_l, use_triton=True)
        src = buffer(chunk)
        src.copy_(chunk)
        want, got = [c.clone() for c in caches], [c.clone() for c in caches]
        transfer.scatter(chunk, want, writes, use_triton=False)
        transfer.scatter(src, got, writes, use_triton=True)
        want_l, got_l = caches[-1].clone(), caches[-1].clone()
        transfer.scatter_layer(chunk[-1], want_l, writes, use_triton=False)
        transfer.scatter_layer(src[-1], got_l, writes, use_triton=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        errors[f"gather all layers{tag}"] = _max_err(out, ref)
        errors[f"gather one layer{tag}"] = _max_err(out_l, ref_l)
        errors[f"scatter all layers{tag}"] = max(_max_err(a, b) for a, b in zip(got, want))
        errors[f"scatter one layer{tag}"] = _max_err(got_l, want_l)
    return errors


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.to(b.device).float() - b.float()).abs().max().item()


def _decode_checks(device: torch.device, sizes: CheckSizes, gen: torch.Generator) -> list[Row]:
    from kvlayer.engine.attention import paged_attention
    from kvlayer.engine.attention_metadata import AttentionMetadata
    from kvlayer.engine.triton_attention import decode_attention

    rows = []
    for dtype in DTYPES:
        worst, dispatched = 0.0, 0.0
        for heads, kv_heads, dim in sizes.decode_gqa:
            lens = torch.tensor(sizes.decode_lens)
            width = -(-max(sizes.decode_lens) // sizes.block_size)
            num_blocks = width + 8
            tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in sizes.decode_lens])
            cache = torch.randn((2, num_blocks, sizes.block_size, kv_heads, dim), generator=gen).to(dtype)
            query = torch.randn((len(lens), heads, dim), generator=gen).to(dtype)
            meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), tables, lens, (),
                                     sizes.block_size)
            ref = paged_attention(query.float(), query, query, cache.float(), meta, dim**-0.5)
            dev = [t.to(device) for t in (query, cache, tables, lens)]
            worst = max(worst, _max_err(decode_attention(*dev[:4], dim**-0.5), ref))
            if device.type == "cuda":  # the engine's own dispatch to the kernel
                meta_dev = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device),
                                               decode_block_tables=dev[2], decode_context_lens=dev[3])
                got = paged_attention(dev[0], dev[0], dev[0], dev[1], meta_dev, dim**-0.5)
                dispatched = max(dispatched, _max_err(got, ref))
        name = str(dtype).removeprefix("torch.")
        rows.append(check_row(f"decode attention {name}", worst, DECODE_TOLERANCE[dtype], "vs torch float32"))
        if device.type == "cuda":
            rows.append(check_row(f"engine paged_attention decode {name}", dispatched, DECODE_TOLERANCE[dtype]))
    return rows


# ----- 2. bandwidth ----------------------------------------------------------------------
def time_cuda(fn: Callable[[], object], iters: int = 20) -> float:
    """Seconds per call of ``fn`` on the current stream (CUDA events, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def bandwidth_rows(device: torch.device, tokens: Sequence[int], goal: float) -> list[Row]:
    """Kernel and pinned-host transfers of the 1B model's chunks against plain ``copy_``s."""
    from kvlayer import transfer

    layers, heads, dim = MODEL_1B["num_hidden_layers"], MODEL_1B["num_key_value_heads"], MODEL_1B["head_dim"]
    block_size = 16
    num_blocks = 2 * -(-max(tokens) // block_size)
    caches = [torch.randn((2, num_blocks, block_size, heads, dim), device=device).to(torch.bfloat16)
              for _ in range(layers)]
    rows = []
    for n in tokens:
        # whole blocks in random order, as a sequence's block table maps them
        blocks = torch.randperm(num_blocks)[: -(-n // block_size)]
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n].to(device)
        chunk = torch.empty((layers, 2, n, heads, dim), dtype=torch.bfloat16, device=device)
        pinned = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True)
        other = torch.empty_like(chunk)
        nbytes = chunk.numel() * chunk.element_size()
        d2d = time_cuda(lambda c=chunk, o=other: o.copy_(c))
        d2h = time_cuda(lambda c=chunk, p=pinned: p.copy_(c, non_blocking=True))
        h2d = time_cuda(lambda c=chunk, p=pinned: c.copy_(p, non_blocking=True))
        note = f"{n} tok, {nbytes / 2**20:.0f} MiB"
        cases = [("gather GPU->GPU", lambda c=chunk, s=slots: transfer.gather(caches, s, c), d2d, "d2d copy_"),
                 ("scatter GPU->GPU", lambda c=chunk, s=slots: transfer.scatter(c, caches, s), d2d, "d2d copy_"),
                 ("gather GPU->pinned", lambda p=pinned, s=slots: transfer.gather(caches, s, p), d2h, "d2h copy_"),
                 ("scatter pinned->GPU", lambda p=pinned, s=slots: transfer.scatter(p, caches, s), h2d, "h2d copy_")]
        for what, fn, ref, ref_name in cases:
            rows.append(bandwidth_row(what, nbytes, time_cuda(fn), ref, goal, f"{note}; vs {ref_name}"))
    return rows


# ----- 3. TTFT -----------------------------------------------------------------------------
def ttft_rows(model: str, args: argparse.Namespace) -> list[Row]:
    """Cold recompute, then hits from the CPU and the GPU tier, for each of ``args.lengths``."""
    modes: dict[str, dict[str, Any] | None] = {
        "cold": None,
        "cpu hit": {"chunk_size": args.chunk_size, "cpu_capacity": "4GiB"},
        "gpu hit": {"chunk_size": args.chunk_size, "gpu_capacity": "4GiB", "cpu_capacity": 0},
    }
    times: dict[str, dict[int, tuple[float, int, int]]] = {}
    for mode, kv_config in modes.items():
        times[mode] = _ttft_mode(model, args, kv_config)
    rows = []
    for n in args.lengths:
        cold_s, _, cold_token = times["cold"][n]
        rows.append(Row("ttft", f"{n} tok cold", cold_s, None, "s"))
        cached = n // args.chunk_size * args.chunk_size
        for mode in ("cpu hit", "gpu hit"):
            hit_s, loaded, token = times[mode][n]
            note = f"loaded {loaded}/{cached} tok; first token {'=' if token == cold_token else '!='} cold's"
            rows.append(Row("ttft", f"{n} tok {mode}", hit_s, cold_s, "s", cold_s / hit_s,
                            loaded >= cached and hit_s < cold_s, note))
    return rows


def _ttft_mode(model: str, args: argparse.Namespace, kv_config: dict[str, Any] | None) -> dict[int, tuple]:
    """``{length: (ttft_s, tokens loaded by kvlayer, first token)}`` of one engine set-up."""
    from kvlayer.engine import LLM

    max_len = max(args.lengths) + args.suffix + 16
    llm = LLM(model, device="cuda", dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="4GiB",
              max_num_batched_tokens=max_len, max_model_len=max_len, kv_config=kv_config)
    try:
        warm = _prompt(2 * args.chunk_size + args.suffix, seed=-1)
        for _ in range(2):  # compiles the kernels: store on the first pass, load on the second
            _first_token(llm, warm)
        out = {}
        for n in args.lengths:
            prompt = _prompt(n + args.suffix, seed=n)
            _first_token(llm, prompt)  # cold: a warm-up run; with kvlayer: the miss that stores
            runs = [_first_token(llm, prompt) for _ in range(2)]
            best = min(runs, key=lambda r: r[0])
            out[n] = best
        return out
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, MODEL_1B["vocab_size"]) for _ in range(n)]


def _first_token(llm: Any, prompt: list[int]) -> tuple[float, int, int]:
    from kvlayer.engine import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))[0]
    return out.metrics.ttft, out.num_external_tokens, out.outputs[0].token_ids[0]


# ----- main ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from kvlayer.kernels import triton_available

    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); on a CPU machine, "
              "`pytest tests/kernels` runs the kernels under Triton's interpreter", file=sys.stderr)
        return 2
    if not triton_available():
        print("gpu_check needs triton (pip install 'kvlayer[triton]')", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    started = time.perf_counter()
    rows = kernel_checks(device)
    rows += bandwidth_rows(device, args.bw_tokens, args.goal)
    if not args.no_ttft:
        with tempfile.TemporaryDirectory(prefix="kvlayer-gpu-check-") as tmp:
            folder = Path(args.model_dir) if args.model_dir else Path(tmp) / "llama-1b"
            model = str(write_model_1b(folder))
            rows += ttft_rows(model, args)
            rows += vllm_rows(model, MODEL_1B["vocab_size"], args, Row)
    title = f"kvlayer gpu_check: {machine_info('cuda')['gpu']} ({time.perf_counter() - started:.0f} s)"
    print_table(title, COLUMNS, table_rows(rows))
    result = report(rows, args, machine_info("cuda"))
    write_json(args.out, result)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
