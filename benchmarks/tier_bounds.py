"""``kvlayer bench bounds``: what bounds the ``KVCacheEngine`` rows of ``bench tiers`` that miss
their goal (docs/benchmarks.md, "What bounds the rows under the goal").

A row's ceiling does one step (one torch ``index_copy_`` per layer; one ``readinto`` or
``write`` per file); kvlayer's op must do more (scatter chunk by chunk; verify a checksum;
gather out of the cache). Here each step an op cannot skip is timed on its own, over the same
sequence as ``bench tiers``'s engine rows (``--tokens`` tokens of the ``--preset`` layout,
float32, ``--chunk-tokens`` per chunk, at the slots of a random block table), alternated round
by round with the ceiling and with the op itself (``tier_ceilings.alternated_times``), medians
kept:

- ``cpu retrieve``: ``scatter_1``, one ``index_copy_`` per chunk and layer from chunk buffers,
  one thread; ``scatter_n``, the same shared among torch's threads (``CopyPlan``, as
  ``retrieve`` runs it); ``keys``, hashing the tokens into chunk keys. Nothing else need be
  done: the floor is the faster scatter plus the keys. ``retrieve`` minus ``scatter_n`` is the
  op's fixed cost (keys, lookup, the I/O loop, the plan) where no OpenMP worker spins beside
  it; ``retrieve`` runs right after the ceiling's parallel copies, as it would after an
  engine's forward pass, and its scatter is slowed there.
- ``nvme retrieve`` (warm: the files in the page cache): ``read``, ``preadv`` of each chunk
  file's payload into a chunk buffer; ``checksum``, xxh3 of each payload; ``scatter_1``.
- ``nvme store``: ``gather_1``, one ``index_select`` per chunk and layer into chunk buffers, one
  thread; ``checksum``; ``write``, one new file per chunk (no fsync, like the tier): the
  ceiling itself, whose run it is.

For the nvme rows the floor is ``max(longest step, sum of steps / speedup)``: the steps spread
perfectly over torch's threads, as if they cost no coordination, where ``speedup`` is what those
threads gain on memory-bound work, measured in the same rounds: a plain copy of the same bytes on
one thread (``copy_1``) against the same copy split among the threads (``copy_n``), kept within
``[1, threads]``. Every nvme step streams the whole KV through memory (a copy, a hash, the page
cache's copy), so more cores help them only as much as they help a copy. ``cores_floor_s`` keeps
the floor with ``speedup = threads`` (memory bandwidth growing with the cores). ``best ratio`` =
ceiling / floor is then about the most any implementation of that op can reach on this machine;
below the goal (0.8), the goal cannot be met here. About: steps that compute besides streaming
(the hash, the page cache's bookkeeping) overlap a little better than a copy, so an op may come
in slightly under its floor (measured: 0.90-1.03 of it, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.common import (
    add_plot_argument,
    close_figure,
    machine_info,
    new_figure,
    positive_int,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.tier_ceilings import BLOCK_SIZE, GOAL_RATIO, alternated_times, drop_page_cache

Run = Callable[[], object]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench bounds`` (``--model`` and ``--device`` are not used)."""
    from kvlayer.benchmarks.tiers import PRESET_NAMES

    p.add_argument("--preset", default="bench", choices=PRESET_NAMES, help="model preset whose KV layout is used")
    p.add_argument("--tokens", type=positive_int, default=2048,
                   help="tokens of the sequence, rounded down to whole chunks (bench tiers's --engine-tokens)")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk")
    p.add_argument("--repeat", type=positive_int, default=9, help="alternated rounds (medians are kept)")
    p.add_argument("--nvme-path", help="folder for the NVMe tier's files (default: a temporary one under --home)")
    add_plot_argument(p)


def main(args: argparse.Namespace) -> int:
    """Measure, print the table, write ``--json``; 0 on success."""
    import torch

    from kvlayer.benchmarks.tier_engine import PagedSequence
    from kvlayer.engine.presets import PRESETS
    from kvlayer.layout import KVLayout

    spec = PRESETS[args.preset]
    chunk = min(args.chunk_tokens, args.tokens)
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, BLOCK_SIZE)
    seq = PagedSequence.random(layout, args.tokens // chunk * chunk)
    Path(args.home).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bounds-", dir=args.nvme_path or args.home) as folder, \
            progress(2, "bench bounds") as advance:
        rows = [_cpu_retrieve(seq, chunk, args.repeat, folder)]
        advance()
        nvme, memory = _nvme_rows(seq, chunk, args.repeat, folder)
        rows += nvme
        advance()
    model = {"name": args.preset, "layers": spec.num_layers, "dtype": "float32"}
    record = {"bench": "bounds", "machine": machine_info("cpu"), "model": model, "settings": settings_of(args),
              "tokens": len(seq.token_ids), "kv_bytes": seq.nbytes, "threads": torch.get_num_threads(),
              "goal_ratio": GOAL_RATIO, "memory": memory, "rows": rows}
    _print(record)
    write_json(args.json, record)
    _plot(args.plot, record)
    return 0


def _cpu_retrieve(seq: Any, chunk: int, repeat: int, folder: str) -> dict[str, Any]:
    import torch

    from kvlayer.benchmarks.tier_ceilings import scatter_runs
    from kvlayer.benchmarks.tier_engine import engine_config
    from kvlayer.cache_engine import KVCacheEngine
    from kvlayer.transfer import CopyPlan

    buffers, slots = _chunk_buffers(seq, chunk)
    pieces = list(zip(buffers, slots))
    one, shared = CopyPlan(pieces), CopyPlan(pieces, threads=torch.get_num_threads())
    config = engine_config("cpu", seq.layout, chunk, seq.nbytes, folder, None)
    with KVCacheEngine(config, seq.layout, model_name="bench-bounds") as engine:
        engine.store(seq.token_ids, seq.src, seq.slots)
        runs: dict[str, tuple[Run, Run | None]] = {
            **{f"ceiling_{k}": (run, None) for k, run in scatter_runs(seq.dst, seq.slots, seq.kv).items()},
            "ours": (_retrieve(engine, seq), None),
            "scatter_1": (lambda: one.scatter(seq.dst), None),
            "scatter_n": (lambda: shared.scatter(seq.dst), None),
            "keys": (lambda: engine.keys(seq.token_ids), None)}
        times = _medians(alternated_times(runs, repeat))
    ceiling = min(v for k, v in times.items() if k.startswith("ceiling_"))
    floor = min(times["scatter_1"], times["scatter_n"]) + times["keys"]
    return _row("cpu", "retrieve", ceiling, times, ["scatter_1", "scatter_n", "keys"], floor,
                {"fixed_s": times["ours"] - times["scatter_n"]})


def _nvme_rows(seq: Any, chunk: int, repeat: int, folder: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The nvme rows, and the memory copies their floors are spread by (``_copy_runs``, ``_speedup``)."""
    import torch
    import xxhash

    from kvlayer.benchmarks.tier_ceilings import read_files_run, write_files_runs
    from kvlayer.benchmarks.tier_engine import engine_config
    from kvlayer.cache_engine import KVCacheEngine
    from kvlayer.serde import HEADER_SIZE
    from kvlayer.transfer import CopyPlan

    threads = torch.get_num_threads()
    buffers, slots = _chunk_buffers(seq, chunk)
    pieces = list(zip(buffers, slots))
    views = [memoryview(b.view(-1).view(torch.uint8).numpy()) for b in buffers]
    plan = CopyPlan(pieces)  # one thread, both ways
    config = engine_config("nvme", seq.layout, chunk, seq.nbytes, folder, None)
    with KVCacheEngine(config, seq.layout, model_name="bench-bounds") as engine, \
            ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="bounds-copy") as pool:
        engine.store(seq.token_ids, seq.src, seq.slots)
        engine.flush(timeout=600)
        root = Path(config.nvme_path or "")

        def files() -> list[str]:  # listed inside each timed read, as the ceiling's are
            return sorted(str(p) for p in root.rglob("*.kvc"))

        if len(files()) != len(buffers):
            raise RuntimeError(f"the nvme tier holds {len(files())} files for {len(buffers)} chunks")

        def read() -> None:
            for path, view in zip(files(), views):
                fd = os.open(path, os.O_RDONLY)
                try:
                    if os.preadv(fd, [view], HEADER_SIZE) != len(view):
                        raise RuntimeError(f"{path} is shorter than a raw chunk")
                finally:
                    os.close(fd)

        def checksum() -> None:
            for view in views:
                xxhash.xxh3_64_intdigest(view)

        sizes = [os.path.getsize(p) for p in files()]
        whole = memoryview(bytearray(b"\1") * sum(sizes))
        write, clear = write_files_runs(tempfile.mkdtemp(prefix="raw-writes-", dir=folder), sizes)
        drop_page_cache(files())  # the warm-up round reads them back in
        runs: dict[str, tuple[Run, Run | None]] = {
            "get_ceiling": (read_files_run(files, whole), None), "get_ours": (_retrieve(engine, seq), None),
            "read": (read, None), "checksum": (checksum, None), "scatter_1": (lambda: plan.scatter(seq.dst), None),
            "put_ceiling": (write, clear), "put_ours": (lambda: _store(engine, seq), engine.evict_all),
            "gather_1": (lambda: plan.gather(seq.src), None),
            **{f"copy_{k}": (run, None) for k, run in _copy_runs(seq.nbytes, threads, pool).items()}}
        times = _medians(alternated_times(runs, repeat))
        clear()
    speedup = _speedup(times, threads)
    get = {"ours": times["get_ours"], **{k: times[k] for k in ("read", "checksum", "scatter_1")}}
    put = {"ours": times["put_ours"], "gather_1": times["gather_1"], "checksum": times["checksum"],
           "write": times["put_ceiling"]}
    memory = {"copy_1_s": times["copy_1"], "copy_n_s": times["copy_n"], "speedup": speedup}
    get_steps, put_steps = ["read", "checksum", "scatter_1"], ["gather_1", "checksum", "write"]
    return [_row("nvme", "retrieve", times["get_ceiling"], get, get_steps, _spread(get, get_steps, speedup),
                 {"reads": "warm", "cores_floor_s": _spread(get, get_steps, threads)}),
            _row("nvme", "store", times["put_ceiling"], put, put_steps, _spread(put, put_steps, speedup),
                 {"cores_floor_s": _spread(put, put_steps, threads)})], memory


def _copy_runs(nbytes: int, threads: int, pool: ThreadPoolExecutor) -> dict[str, Run]:
    """A plain copy of ``nbytes`` between two buffers: on one thread (``1``), and split into
    ``threads`` parts, this thread copying the first and ``pool`` the others (``n``; numpy
    copies, which release the GIL)."""
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    step = -(-nbytes // max(1, threads))
    parts = [(dst[i:i + step], src[i:i + step]) for i in range(0, nbytes, step)]

    def split() -> None:
        futures = [pool.submit(np.copyto, d, s) for d, s in parts[1:]]
        np.copyto(*parts[0])
        for f in futures:
            f.result()

    return {"1": lambda: np.copyto(dst, src), "n": split}


def _speedup(times: dict[str, float], threads: int) -> float:
    """How much faster ``threads`` threads move memory than one, measured (``copy_1 / copy_n``),
    kept within ``[1, threads]``: what spreading memory-bound steps over the cores can gain."""
    return min(float(threads), max(1.0, times["copy_1"] / times["copy_n"]))


def _chunk_buffers(seq: Any, chunk: int) -> tuple[list[Any], list[Any]]:
    """The sequence's KV as one buffer per chunk (``layout.chunk_view`` shape), and each chunk's slots."""
    n = len(seq.token_ids) // chunk
    buffers = [seq.kv[:, :, i * chunk:(i + 1) * chunk].contiguous() for i in range(n)]
    return buffers, [seq.slots[i * chunk:(i + 1) * chunk] for i in range(n)]


def _retrieve(engine: Any, seq: Any) -> Run:
    def run() -> None:
        if engine.retrieve(seq.token_ids, seq.dst, seq.slots) != len(seq.token_ids):
            raise RuntimeError("retrieve did not give the whole sequence back")
    return run


def _store(engine: Any, seq: Any) -> None:
    engine.store(seq.token_ids, seq.src, seq.slots)
    if not engine.flush(timeout=600):
        raise RuntimeError("the store did not reach the tier")


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def _spread(times: dict[str, float], steps: list[str], speedup: float) -> float:
    """The floor of ``steps`` spread perfectly over threads that together run ``speedup`` times
    as fast as one: the longest step, or their sum over ``speedup``, whichever is longer."""
    return max(max(times[s] for s in steps), sum(times[s] for s in steps) / max(1.0, speedup))


def _row(tier: str, op: str, ceiling: float, times: dict[str, float], steps: list[str], floor: float,
         extra: dict[str, Any]) -> dict[str, Any]:
    return {"tier": tier, "op": op, "ceiling_s": ceiling, "ours_s": times["ours"],
            "steps_s": {s: times[s] for s in steps}, "floor_s": floor, "ratio": ceiling / times["ours"],
            "best_ratio": ceiling / floor, "goal_reachable": ceiling / floor >= GOAL_RATIO, **extra}


def _print(record: dict[str, Any]) -> None:
    rows = [[f"{r['tier']} {r['op']}" + (f" ({r['reads']})" if r.get("reads") else ""), 1e3 * r["ceiling_s"],
             1e3 * r["ours_s"], ", ".join(f"{k} {1e3 * v:.2f}" for k, v in r["steps_s"].items()),
             1e3 * r["floor_s"], r["ratio"], r["best_ratio"]] for r in record["rows"]]
    print_table(f"bench bounds: {record['tokens']} tokens ({record['kv_bytes'] / 2**20:.0f} MiB of KV), "
                f"{record['threads']} torch threads, medians of {record['settings'].get('repeat')} alternated rounds",
                ["op", "ceiling ms", "ours ms", "steps ms", "floor ms", "ratio", "best ratio"], rows)
    cpu = next(r for r in record["rows"] if r["tier"] == "cpu")
    print(f"cpu retrieve: ours - scatter_n {1e3 * cpu['fixed_s']:.2f} ms")
    memory = record["memory"]
    print(f"memory: a {record['kv_bytes'] / 2**20:.0f} MiB copy takes {1e3 * memory['copy_1_s']:.2f} ms on one thread, "
          f"{1e3 * memory['copy_n_s']:.2f} ms on {record['threads']}: the nvme floors spread their steps "
          f"{memory['speedup']:.2f}x")
    for r in record["rows"]:
        verdict = "reachable" if r["goal_reachable"] else "out of reach on this machine"
        print(f"{r['tier']} {r['op']}: best ratio {r['best_ratio']:.2f} against the goal {GOAL_RATIO}: {verdict}")


def _plot(path: str | None, record: dict[str, Any]) -> None:
    """Per op: the ceiling's time, ours, and the floor of its steps (ms)."""
    if not path:
        return
    fig, axes = new_figure(1, 1, (9, 4.5))
    ax = axes[0][0]
    rows = record["rows"]
    for k, (key, label) in enumerate((("ceiling_s", "ceiling"), ("ours_s", "ours"), ("floor_s", "floor of the steps"))):
        ax.bar([i + 0.27 * (k - 1) for i in range(len(rows))], [1e3 * r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['tier']} {r['op']}\nbest ratio {r['best_ratio']:.2f}" for r in rows])
    ax.set_ylabel("ms (median)")
    ax.set_title("What bounds the KVCacheEngine rows: ceiling, ours, and the floor of the steps")
    ax.legend()
    save_figure(fig, path, record, f"{record['tokens']} tokens, {record['threads']} torch threads")
    close_figure(fig)
