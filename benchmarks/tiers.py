"""``kvlayer bench tiers``: get and put throughput of each storage tier next to its raw ceiling.

Chunks have the KV layout of the ``--preset`` model in float32 (layers x 2 x tokens x
kv_heads x head_dim x 4 bytes: 6 MiB for the ``bench`` preset's 256-token chunk), one size per
``--chunk-tokens``. Each tier puts, then gets, one batch of ``--chunks`` chunks through its
``StorageBackend`` methods (best of ``--repeat``), without and with lz4 (nvme and redis: per
``--quantizations`` too, exact only by default), and is compared with the raw ceiling measured in
the same run (``kvlayer.benchmarks.tier_ceilings``); ``B/tok`` is what the tier stored per token:

- cpu: put copies into the tier's arena; get hands out the tier's own slots (zero copy), so
  it is timed with the one copy any consumer makes out of them. Ceiling: memcpy.
- nvme: put writes files (no fsync, the tier's default); get reads them warm (still in the
  page cache) and cold (dropped first). Ceiling: plain sequential file writes and reads.
- redis: pipelined ``MSETNX``/``MGET`` of each chunk's two keys (header + the payload's
  last bytes, and the rest of the payload). Ceiling: raw redis-py pipelined ``SET``/``GET`` of
  values of the chunk's size. Also Redis memory (``MEMORY USAGE`` of both keys) per byte of KV.

Then ``KVCacheEngine`` itself (``kvlayer.benchmarks.tier_engine``): per tier, ``retrieve`` of a
``--engine-tokens`` sequence into a paged cache at a random block table, and its durable
``store`` (store + flush), median of ``--repeat`` rounds alternating with the tier's raw ceiling
for the same bytes (cpu: torch ``index_copy_``/``index_select`` of the same slots; nvme: plain
reads, warm and cold, and writes of the tier's files; redis: raw pipelined ``GET``s/``SET``s),
with a goal line per row (ours >= ``GOAL_RATIO`` of the ceiling).

With int8 or fp8 among ``--quantizations``, the quality rows (``kvlayer.benchmarks.tier_quality``):
NVMe hits of a random ``--preset`` model through the bundled engine, quantized and exact: bytes per
token, TTFT, greedy-token agreement and the largest logit difference against no kvlayer.

Throughput counts KV bytes (the raw chunk, before lz4) per second; data is random float32
(real-valued KV barely compresses). ``--redis-url`` names a server; without it a local
redis-server is started when the binary exists, else the Redis rows are skipped with a note.
``KVLAYER_SMOKE=1`` shrinks the run to the ``tiny`` preset, 4 chunks and one run.

Run: ``kvlayer bench tiers [--chunk-tokens 64,256] [--engine-tokens 2048] [--quantizations none,int8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlayer.benchmarks.common import (
    add_plot_argument,
    close_figure,
    machine_info,
    new_figure,
    nonnegative_int,
    positive_int,
    positive_ints,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.tier_ceilings import BLOCK_SIZE, GOAL_RATIO, file_rates, memcpy_rate, redis_rates
from kvlayer.benchmarks.tier_ceilings import CEILINGS as ENGINE_CEILINGS

if TYPE_CHECKING:
    from kvlayer.benchmarks.tier_runs import Batch
    from kvlayer.config import KVLayerConfig
    from kvlayer.layout import KVLayout

TIERS = ("cpu", "nvme", "redis")
GOAL_GET_RATIO = 0.8
GOAL_REDIS_MEMORY = 1.05
CEILINGS = {
    "memcpy": "torch copies into memory already touched, one per chunk",
    "file": "sequential write/readinto of same-size files; cold = after fsync + posix_fadvise(DONTNEED)",
    "redis": "redis-py sync client, one pipeline of SET/GET of same-size values, PythonRespSerializer packing",
}


PRESET_NAMES = ("bench", "small", "tiny")
"""The model presets (``kvlayer.engine.presets.PRESETS``; a test keeps the two equal), listed
here so that building the command line imports no torch."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench tiers`` (``--model`` and ``--device`` are not used)."""
    from kvlayer.config import QUANTIZATIONS

    p.add_argument("--preset", default="bench", choices=PRESET_NAMES,
                   help="model preset whose KV layout sizes the chunks")
    p.add_argument("--chunk-tokens", type=positive_ints, default=[256], help="tokens per chunk, a comma-separated list")
    p.add_argument("--chunks", type=positive_int, default=16, help="chunks per put or get batch")
    p.add_argument("--repeat", type=positive_int, default=5, help="runs per figure (the best is kept)")
    p.add_argument("--tiers", type=_names_of(TIERS, "tier"), default=list(TIERS),
                   help=f"tiers to measure, of {list(TIERS)}")
    p.add_argument("--compressions", type=_names_of(("none", "lz4"), "compression"), default=["none", "lz4"],
                   help="payload compressions to measure")
    p.add_argument("--quantizations", type=_names_of(QUANTIZATIONS, "quantization"), default=["none"],
                   help="storage_quantization values to measure on nvme and redis (int8 or fp8 adds the quality rows)")
    p.add_argument("--quality-prompts", type=nonnegative_int, default=8,
                   help="prompts of the quality rows (0: no such rows)")
    p.add_argument("--quality-tokens", type=positive_int, default=16, help="greedy tokens per prompt there")
    p.add_argument("--nvme-path", help="folder for the disk figures (default: a temporary one under --home)")
    p.add_argument("--redis-url", help="Redis server to measure (default: a local redis-server, if installed)")
    p.add_argument("--engine-tokens", type=nonnegative_int, default=2048,
                   help="tokens the KVCacheEngine rows store and retrieve, rounded down to whole chunks "
                        "(0: no such rows)")
    p.add_argument("--torch-threads", type=nonnegative_int, default=0,
                   help="torch threads for the copies (0: torch's default; 1 steadies figures on a busy machine)")
    add_plot_argument(p)


def _names_of(allowed: tuple[str, ...] | list[str], what: str) -> Callable[[str], list[str]]:
    """A ``type=`` function: comma-separated names, each one of ``allowed``, no empty item."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        for name in names:
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; choose from {list(allowed)}")
        return names

    parse.__name__ = f"{what} list"
    return parse


def main(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``--json`` and ``--plot``; 0 on success (ValueError for a bad option)."""
    from kvlayer.benchmarks.tier_quality import print_quality, quality_rows
    from kvlayer.engine.presets import PRESETS

    tiers, compressions, quantizations = list(args.tiers), list(args.compressions), list(args.quantizations)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    notes: list[str] = []
    if os.environ.get("KVLAYER_SMOKE") == "1":  # the docs' smoke runs: the documented command, tiny sizes
        args = argparse.Namespace(**{**vars(args), "preset": "tiny", "chunks": min(args.chunks, 4), "repeat": 1,
                                     "engine_tokens": min(args.engine_tokens, 256),
                                     "quality_prompts": min(args.quality_prompts, 2),
                                     "quality_tokens": min(args.quality_tokens, 4)})
        notes.append("KVLAYER_SMOKE=1: tiny preset, at most 4 chunks and 256 engine tokens, one run")
    with _redis_url(args.redis_url if "redis" in tiers else None, "redis" in tiers, notes) as url, \
            _nvme_folder(args.nvme_path, args.home) as folder:
        sizes = list(args.chunk_tokens)
        runs = len(sizes) * sum((1 if t == "cpu" else len(compressions) * len(quantizations)) + bool(args.engine_tokens)
                                for t in tiers)
        with progress(runs, "bench tiers") as advance:
            results = [_measure_size(args, PRESETS[args.preset], n, tiers, (compressions, quantizations), folder, url,
                                     advance) for n in sizes]
        quality = quality_rows(args, quantizations, folder, sizes[0])
    notes += _memory_notes(results)
    _print(args, results, notes)
    print_quality(quality)
    spec = PRESETS[args.preset]
    model = {"name": args.preset, "preset": args.preset, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
             "head_dim": spec.head_dim, "dtype": "float32"}
    record = {"machine": machine_info("cpu"), "model": model, "settings": settings_of(args),
              "preset": args.preset, "chunks": args.chunks,
              "repeat": args.repeat, "goals": {"get_ratio": GOAL_GET_RATIO,
                                               "redis_memory_per_kv_byte": GOAL_REDIS_MEMORY,
                                               "engine_ratio": GOAL_RATIO},
              "ceilings": CEILINGS, "engine_ceilings": ENGINE_CEILINGS, "notes": notes, "results": results,
              "quality": quality}
    write_json(args.json, record)
    _plot(args.plot, results, record)
    return 0


def _plot(path: str | None, results: list[dict[str, Any]], record: dict[str, Any]) -> None:
    """Bars of each tier's get and put ratio to its raw ceiling, per chunk size."""
    if not path:
        return
    sections = [res for res in results if res.get("engine")]
    fig, axes = new_figure(1, 3 if sections else 2, (16, 4.5) if sections else (11, 4.5))
    for ax, op in zip(axes[0], ("get", "put")):
        labels, values = [], []
        for res in results:
            for r in res["tiers"]:
                quant = "" if r["quantization"] == "none" else f"/{r['quantization']}"
                labels.append(f"{r['tier']}/{r['compression']}{quant}\n{res['chunk_tokens']} tok")
                values.append(r.get(f"{op}_ratio") or 0.0)
        ax.bar(range(len(values)), values, color="tab:blue" if op == "get" else "tab:orange")
        ax.axhline(GOAL_GET_RATIO, color="0.4", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel(f"{op} GiB/s / raw ceiling")
        ax.set_title(f"{op}: tier throughput relative to its raw ceiling")
    if sections:
        ax = axes[0][2]
        rows = [(res["chunk_tokens"], r) for res in sections for r in res["engine"]["rows"]]
        ax.bar(range(len(rows)), [r["ratio"] for _, r in rows],
               color=["tab:blue" if r["op"] == "retrieve" else "tab:orange" for _, r in rows])
        ax.axhline(GOAL_RATIO, color="0.4", linestyle="--", linewidth=1)
        labels = [f"{r['tier']}{'' if r['reads'] == '-' else ' ' + r['reads']}\n{r['op']}\n{n} tok" for n, r in rows]
        ax.set_xticks(range(len(rows)), labels, fontsize=6)
        ax.set_ylabel("KVCacheEngine GiB/s / raw ceiling")
        ax.set_title("KVCacheEngine retrieve and store relative to the raw ceiling")
    save_figure(fig, path, record, "bench tiers")
    close_figure(fig)


def _measure_size(args: argparse.Namespace, preset: Any, tokens: int, tiers: list[str],
                  encodings: tuple[list[str], list[str]], folder: str, url: str | None,
                  advance: Callable[[], None]) -> dict[str, Any]:
    """Ceilings and tier figures for one chunk size; ``encodings`` are the compressions and the
    quantizations to measure (cpu: exact payloads only)."""
    import torch  # here, not at the top: building the CLI parser imports this module

    from kvlayer.benchmarks.tier_runs import Batch, measure_tier, redis_memory_ratio
    from kvlayer.layout import KVLayout
    from kvlayer.serde import HEADER_SIZE

    layout = KVLayout(preset.num_layers, preset.num_kv_heads, preset.head_dim, torch.float32, 16)
    batch = Batch.random(layout, tokens, args.chunks)
    value = HEADER_SIZE + batch.chunk_bytes
    ceilings: dict[str, Any] = {}
    rows = []
    try:
        for tier in tiers:
            if tier == "redis" and url is None:
                continue
            # Each ceiling is measured right before its tier, so both see the same machine load.
            ceilings[_CEILING_OF[tier][0]] = _ceiling(tier, args.chunks, value, args.repeat, folder, url)
            for comp, quant in _encodings(tier, *encodings):
                config = _config(tier, batch, comp, quant, folder, url)
                figures = asyncio.run(measure_tier(tier, config, batch, args.repeat))
                if tier == "redis":
                    figures["memory_per_kv_byte"] = redis_memory_ratio(config, batch)
                rows.append({"tier": tier, "compression": comp, "quantization": quant, **figures,
                             **_ratios(tier, figures, ceilings)})
                advance()
    finally:
        batch.close()
    engine = _engine_rows(args, layout, tokens, [t for t in tiers if t != "redis" or url], folder, url, advance)
    return {"chunk_tokens": tokens, "chunk_bytes": layout.chunk_bytes(tokens), "value_bytes": value,
            "ceilings_gib_s": ceilings, "tiers": rows, "engine": engine}


def _engine_rows(args: argparse.Namespace, layout: KVLayout, chunk_tokens: int, tiers: list[str], folder: str,
                 url: str | None, advance: Callable[[], None]) -> dict[str, Any] | None:
    """The ``KVCacheEngine`` rows at this chunk size (None with ``--engine-tokens 0``)."""
    if not args.engine_tokens:
        return None
    import dataclasses

    from kvlayer.benchmarks.tier_engine import PagedSequence, measure_engine

    tokens = max(chunk_tokens, args.engine_tokens // chunk_tokens * chunk_tokens)
    seq = PagedSequence.random(dataclasses.replace(layout, block_size=BLOCK_SIZE), tokens)
    rows = []
    for tier in tiers:
        rows += measure_engine(tier, seq, chunk_tokens, args.repeat, folder, url)
        advance()
    return {"tokens": tokens, "kv_bytes": seq.nbytes, "block_size": BLOCK_SIZE, "rows": rows}


def _encodings(tier: str, compressions: list[str], quantizations: list[str]) -> list[tuple[str, str]]:
    """The (compression, quantization) pairs measured on ``tier``."""
    return [("none", "none")] if tier == "cpu" else [(c, q) for c in compressions for q in quantizations]


def _config(tier: str, batch: Batch, compression: str, quantization: str, folder: str,
            url: str | None) -> KVLayerConfig:
    """The configuration enabling only ``tier``, sized for ``batch`` (deadlines out of the way)."""
    from kvlayer.config import KVLayerConfig

    settings: dict[str, Any] = {"chunk_size": batch.tokens, "compression": compression, "tier_timeout_ms": 600_000,
                                "storage_quantization": quantization, "cpu_capacity": 0,
                                "staging_capacity": (batch.count + 1) * batch.chunk_bytes}
    name = compression if quantization == "none" else f"{compression}-{quantization}"
    if tier == "cpu":
        settings["cpu_capacity"] = (batch.count + 1) * batch.chunk_bytes
    elif tier == "nvme":
        settings.update(nvme_path=str(Path(folder) / f"tier-{name}"), nvme_capacity=4 * batch.nbytes)
    else:
        settings.update(redis_url=url, redis_key_prefix=f"kvlayer-bench-{name}")
    return KVLayerConfig(**settings)


_CEILING_OF = {"cpu": ("memcpy", "get", "put"), "nvme": ("file", "get_warm", "put"), "redis": ("redis", "get", "put")}
"""Per tier: its ceiling's name, and the ceiling's figures its get and put compare with."""


def _ceiling(tier: str, count: int, value: int, repeat: int, folder: str, url: str | None) -> dict[str, Any]:
    """The raw ceiling's figures (GiB/s) for ``tier``, for ``count`` values of ``value`` bytes."""
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "cpu": lambda: dict.fromkeys(("put", "get"), memcpy_rate(count, value, repeat)),
        "nvme": lambda: file_rates(folder, count, value, repeat),
        "redis": lambda: redis_rates(str(url), count, value, repeat),
    }
    return runs[tier]()


def _ratios(tier: str, figures: dict[str, Any], ceilings: dict[str, Any]) -> dict[str, Any]:
    """Each figure next to its ceiling, and their ratio."""
    name, get_key, put_key = _CEILING_OF[tier]
    ceiling = ceilings[name]
    out = {"ceiling": name, "get_ceiling_gib_s": ceiling[get_key], "put_ceiling_gib_s": ceiling[put_key],
           "get_ratio": figures["get_gib_s"] / ceiling[get_key], "put_ratio": figures["put_gib_s"] / ceiling[put_key]}
    if tier == "nvme":
        cold = ceiling["get_cold"]
        out["get_cold_ceiling_gib_s"] = cold
        out["get_cold_ratio"] = figures["get_cold_gib_s"] / cold if cold and figures.get("get_cold_gib_s") else None
    return out


def _memory_notes(results: list[dict[str, Any]]) -> list[str]:
    """Why Redis may hold more than the goal: its allocator rounds a value up to a size class."""
    return [f"redis holds {r['memory_per_kv_byte']:.3f} bytes per KV byte at {res['chunk_tokens']} tokens "
            f"({r['compression']}, {r['quantization']}): its allocator rounds each of a chunk's two values up to "
            f"a size class, and a body (the payload less 128 bytes) just above a class size pays the next one"
            for res in results for r in res["tiers"]
            if r["tier"] == "redis" and r["memory_per_kv_byte"] >= GOAL_REDIS_MEMORY]


def _print(args: argparse.Namespace, results: list[dict[str, Any]], notes: list[str]) -> None:
    cols = ["tokens", "MiB", "tier", "comp", "quant", "reads", "get GiB/s", "ceiling", "get ratio", "put GiB/s",
            "ceiling", "put ratio", "B/tok", "mem/KV"]
    rows = []
    for res in results:
        mib = res["chunk_bytes"] / 2**20
        for r in res["tiers"]:
            reads = "warm" if r["tier"] == "nvme" else "-"
            rows.append([res["chunk_tokens"], mib, r["tier"], r["compression"], r["quantization"], reads,
                         r["get_gib_s"], r["get_ceiling_gib_s"], r["get_ratio"], r["put_gib_s"],
                         r["put_ceiling_gib_s"], r["put_ratio"], r["stored_bytes_per_token"],
                         r.get("memory_per_kv_byte")])
            if r["tier"] == "nvme" and r.get("get_cold_gib_s") is not None:
                rows.append([res["chunk_tokens"], mib, "nvme", r["compression"], r["quantization"], "cold",
                             r["get_cold_gib_s"], r["get_cold_ceiling_gib_s"], r["get_cold_ratio"], None, None, None,
                             None, None])
    print_table(f"bench tiers: '{args.preset}' preset, float32, {args.chunks} chunks per batch, best of "
                f"{args.repeat} (goals: get ratio >= {GOAL_GET_RATIO}, Redis memory/KV < {GOAL_REDIS_MEMORY})",
                cols, rows)
    for note in notes:
        print(f"note: {note}")
    _print_engine(args, results)


def _print_engine(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """The KVCacheEngine table, then one goal line per row."""
    sections = [(res["chunk_tokens"], res["engine"]) for res in results if res.get("engine")]
    if not sections:
        return
    cols = ["chunk", "tokens", "MiB", "tier", "op", "reads", "ms", "GiB/s", "ceiling", "ceiling ms", "ceiling GiB/s",
            "ratio"]
    rows = [[chunk, eng["tokens"], eng["kv_bytes"] / 2**20, r["tier"], r["op"], r["reads"], 1e3 * r["seconds"],
             r["gib_s"], r["ceiling"], 1e3 * r["ceiling_seconds"], r["ceiling_gib_s"], r["ratio"]]
            for chunk, eng in sections for r in eng["rows"]]
    print_table(f"bench tiers: KVCacheEngine retrieve and durable store (store + flush) at random block-table "
                f"slots, median of {args.repeat}, next to each tier's raw ceiling (goal: ratio >= {GOAL_RATIO})",
                cols, rows)
    for line in goal_lines(sections):
        print(line)


def goal_lines(sections: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """One line per KVCacheEngine row, ``retrieve cpu 0.83 of ceiling (goal >= 0.80): met``; the chunk
    size is named when there are several."""
    lines = []
    for chunk, eng in sections:
        at = f" ({chunk}-token chunks)" if len(sections) > 1 else ""
        for r in eng["rows"]:
            reads = f" {r['reads']}" if r["reads"] != "-" else ""
            lines.append(f"{r['op']} {r['tier']}{reads}{at} {r['ratio']:.2f} of ceiling (goal >= {GOAL_RATIO:.2f}): "
                         f"{'met' if r['goal_met'] else 'NOT met'}")
    return lines


@contextlib.contextmanager
def _redis_url(url: str | None, wanted: bool, notes: list[str]) -> Iterator[str | None]:
    """``url``, else a local redis-server's while the context lasts, else None (noted)."""
    if url is not None or not wanted:
        yield url
        return
    from kvlayer.benchmarks.redis_local import LocalRedis

    if not LocalRedis.available():
        notes.append("redis rows skipped: no --redis-url and no redis-server on PATH")
        yield None
        return
    with LocalRedis() as server:
        notes.append(f"redis: a local redis-server started for this run ({server.url})")
        yield server.url


@contextlib.contextmanager
def _nvme_folder(path: str | None, home: str) -> Iterator[str]:
    """A fresh folder for the disk figures, inside ``path`` or ``home``, deleted afterwards."""
    parent = Path(path or home)
    parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="bench-tiers-", dir=parent)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)

