"""``kvlayer bench tiers``: get and put throughput of each storage tier next to its raw ceiling.

Chunks have the KV layout of the ``--preset`` model in float32 (layers x 2 x tokens x
kv_heads x head_dim x 4 bytes: 6 MiB for the ``bench`` preset's 256-token chunk), one size per
``--chunk-tokens``. Each tier puts, then gets, one batch of ``--chunks`` chunks through its
``StorageBackend`` methods (best of ``--repeat``), without and with lz4, and is compared with
the raw ceiling measured in the same run (``kvlayer.benchmarks.tier_ceilings``):

- cpu: put copies into the tier's arena; get hands out the tier's own slots (zero copy), so
  it is timed with the one copy any consumer makes out of them. Ceiling: memcpy.
- nvme: put writes files (no fsync, the tier's default); get reads them warm (still in the
  page cache) and cold (dropped first). Ceiling: plain sequential file writes and reads.
- redis: pipelined ``MSETNX``/``MGET`` of each chunk's two keys (header + the payload's
  last bytes, and the rest of the payload). Ceiling: raw redis-py pipelined ``SET``/``GET`` of
  values of the chunk's size. Also Redis memory (``MEMORY USAGE`` of both keys) per byte of KV.

Throughput counts KV bytes (the raw chunk, before lz4) per second; data is random float32
(real-valued KV barely compresses). ``--redis-url`` names a server; without it a local
redis-server is started when the binary exists, else the Redis rows are skipped with a note.
``KVLAYER_SMOKE=1`` shrinks the run to the ``tiny`` preset, 4 chunks and one run.

Run: ``kvlayer bench tiers [--chunk-tokens 64,256] [--json PATH]``.
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
    parse_ints,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.tier_ceilings import file_rates, memcpy_rate, redis_rates

if TYPE_CHECKING:
    from kvlayer.benchmarks.tier_runs import Batch
    from kvlayer.config import KVLayerConfig

TIERS = ("cpu", "nvme", "redis")
GOAL_GET_RATIO = 0.8
GOAL_REDIS_MEMORY = 1.05
CEILINGS = {
    "memcpy": "torch copies into memory already touched, one per chunk",
    "file": "sequential write/readinto of same-size files; cold = after fsync + posix_fadvise(DONTNEED)",
    "redis": "redis-py sync client, one pipeline of SET/GET of same-size values, PythonRespSerializer packing",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench tiers`` (``--model`` and ``--device`` are not used)."""
    p.add_argument("--preset", default="bench", help="model preset whose KV layout sizes the chunks")
    p.add_argument("--chunk-tokens", default="256", help="tokens per chunk, a comma-separated list")
    p.add_argument("--chunks", type=int, default=16, help="chunks per put or get batch")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (the best is kept)")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"tiers to measure, of {list(TIERS)}")
    p.add_argument("--compressions", default="none,lz4", help="payload compressions to measure")
    p.add_argument("--nvme-path", help="folder for the disk figures (default: a temporary one under --home)")
    p.add_argument("--redis-url", help="Redis server to measure (default: a local redis-server, if installed)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads for the copies (0: torch's default; 1 steadies figures on a busy machine)")
    add_plot_argument(p)


def main(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``--json`` and ``--plot``; 0 on success (ValueError for a bad option)."""
    from kvlayer.engine.presets import PRESETS

    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(PRESETS)}")
    tiers = [t for t in args.tiers.split(",") if t]
    compressions = [c for c in args.compressions.split(",") if c]
    for t in tiers:
        if t not in TIERS:
            raise ValueError(f"unknown tier {t!r}; choose from {list(TIERS)}")
    if args.chunks <= 0 or args.repeat <= 0 or args.torch_threads < 0:
        raise ValueError("--chunks and --repeat must be positive, --torch-threads >= 0")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    notes: list[str] = []
    if os.environ.get("KVLAYER_SMOKE") == "1":  # the docs' smoke runs: the documented command, tiny sizes
        args = argparse.Namespace(**{**vars(args), "preset": "tiny", "chunks": min(args.chunks, 4), "repeat": 1})
        notes.append("KVLAYER_SMOKE=1: tiny preset, at most 4 chunks, one run")
    with _redis_url(args.redis_url if "redis" in tiers else None, "redis" in tiers, notes) as url, \
            _nvme_folder(args.nvme_path, args.home) as folder:
        sizes = parse_ints(args.chunk_tokens)
        runs = len(sizes) * sum(1 if t == "cpu" else len(compressions) for t in tiers)
        with progress(runs, "bench tiers") as advance:
            results = [_measure_size(args, PRESETS[args.preset], n, tiers, compressions, folder, url, advance)
                       for n in sizes]
    notes += _memory_notes(results)
    _print(args, results, notes)
    spec = PRESETS[args.preset]
    model = {"name": args.preset, "preset": args.preset, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
             "head_dim": spec.head_dim, "dtype": "float32"}
    record = {"machine": machine_info("cpu"), "model": model, "settings": settings_of(args),
              "preset": args.preset, "chunks": args.chunks,
              "repeat": args.repeat, "goals": {"get_ratio": GOAL_GET_RATIO,
                                               "redis_memory_per_kv_byte": GOAL_REDIS_MEMORY},
              "ceilings": CEILINGS, "notes": notes, "results": results}
    write_json(args.json, record)
    _plot(args.plot, results, record)
    return 0


def _plot(path: str | None, results: list[dict[str, Any]], record: dict[str, Any]) -> None:
    """Bars of each tier's get and put ratio to its raw ceiling, per chunk size."""
    if not path:
        return
    fig, axes = new_figure(1, 2)
    for ax, op in zip(axes[0], ("get", "put")):
        labels, values = [], []
        for res in results:
            for r in res["tiers"]:
                labels.append(f"{r['tier']}/{r['compression']}\n{res['chunk_tokens']} tok")
                values.append(r.get(f"{op}_ratio") or 0.0)
        ax.bar(range(len(values)), values, color="tab:blue" if op == "get" else "tab:orange")
        ax.axhline(GOAL_GET_RATIO, color="0.4", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel(f"{op} GiB/s / raw ceiling")
        ax.set_title(f"{op}: tier throughput relative to its raw ceiling")
    save_figure(fig, path, record, "bench tiers")
    close_figure(fig)


def _measure_size(args: argparse.Namespace, preset: Any, tokens: int, tiers: list[str], compressions: list[str],
                  folder: str, url: str | None, advance: Callable[[], None]) -> dict[str, Any]:
    """Ceilings and tier figures for one chunk size."""
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
            for comp in compressions if tier != "cpu" else ["none"]:
                config = _config(tier, batch, comp, folder, url)
                figures = asyncio.run(measure_tier(tier, config, batch, args.repeat))
                if tier == "redis":
                    figures["memory_per_kv_byte"] = redis_memory_ratio(config, batch)
                rows.append({"tier": tier, "compression": comp, **figures, **_ratios(tier, figures, ceilings)})
                advance()
    finally:
        batch.close()
    return {"chunk_tokens": tokens, "chunk_bytes": layout.chunk_bytes(tokens), "value_bytes": value,
            "ceilings_gib_s": ceilings, "tiers": rows}


def _config(tier: str, batch: Batch, compression: str, folder: str, url: str | None) -> KVLayerConfig:
    """The configuration enabling only ``tier``, sized for ``batch`` (deadlines out of the way)."""
    from kvlayer.config import KVLayerConfig

    settings: dict[str, Any] = {"chunk_size": batch.tokens, "compression": compression, "tier_timeout_ms": 600_000,
                                "cpu_capacity": 0, "staging_capacity": (batch.count + 1) * batch.chunk_bytes}
    if tier == "cpu":
        settings["cpu_capacity"] = (batch.count + 1) * batch.chunk_bytes
    elif tier == "nvme":
        settings.update(nvme_path=str(Path(folder) / f"tier-{compression}"), nvme_capacity=4 * batch.nbytes)
    else:
        settings.update(redis_url=url, redis_key_prefix=f"kvlayer-bench-{compression}")
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
            f"({r['compression']}): its allocator rounds each of a chunk's two values up to a size class, "
            f"and a body (the payload less 128 bytes) just above a class size pays the next one"
            for res in results for r in res["tiers"]
            if r["tier"] == "redis" and r["memory_per_kv_byte"] >= GOAL_REDIS_MEMORY]


def _print(args: argparse.Namespace, results: list[dict[str, Any]], notes: list[str]) -> None:
    cols = ["tokens", "MiB", "tier", "comp", "reads", "get GiB/s", "ceiling", "get ratio", "put GiB/s", "ceiling",
            "put ratio", "mem/KV"]
    rows = []
    for res in results:
        mib = res["chunk_bytes"] / 2**20
        for r in res["tiers"]:
            reads = "warm" if r["tier"] == "nvme" else "-"
            rows.append([res["chunk_tokens"], mib, r["tier"], r["compression"], reads, r["get_gib_s"],
                         r["get_ceiling_gib_s"], r["get_ratio"], r["put_gib_s"], r["put_ceiling_gib_s"],
                         r["put_ratio"], r.get("memory_per_kv_byte")])
            if r["tier"] == "nvme" and r.get("get_cold_gib_s") is not None:
                rows.append([res["chunk_tokens"], mib, "nvme", r["compression"], "cold", r["get_cold_gib_s"],
                             r["get_cold_ceiling_gib_s"], r["get_cold_ratio"], None, None, None, None])
    print_table(f"bench tiers: '{args.preset}' preset, float32, {args.chunks} chunks per batch, best of "
                f"{args.repeat} (goals: get ratio >= {GOAL_GET_RATIO}, Redis memory/KV < {GOAL_REDIS_MEMORY})",
                cols, rows)
    for note in notes:
        print(f"note: {note}")


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

