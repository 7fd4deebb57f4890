"""``kvlayer bench cache-server``: the node cache server against an in-process CPU tier, and across a restart.

The bench starts a ``kvlayer cache-server`` itself (a subprocess on a temporary socket, its arena
sized for both figures) and measures, through ``KVCacheEngine`` with one tier each, float32 KV of
the ``--preset`` layout at random slots of a paged cache (``tier_engine.PagedSequence``, as the
CPU rows of ``kvlayer bench tiers``):

1. One prefix of ``--mib`` MiB (48: 2048 tokens of the ``bench`` layout), in this process: the
   server's tier (``cache``, ``cpu_capacity: 0``) and an in-process CPU tier (``cpu``). Each side
   stores it and gives it back byte for byte (checked before anything is timed); then
   ``--repeat`` rounds, after an untimed warm-up one, alternate the sides' ``retrieve`` and
   durable ``store`` (store + flush, after an untimed removal). Medians and best runs; the ratio
   is server over in-process (goal: retrieve <= ``GOAL_RETRIEVE``).
2. A restart (``kvlayer.benchmarks.cache_server_worker``): one engine process stores a prefix of
   ``--restart-tokens`` through the server, times warm hits and exits; then ``--restarts`` times
   two fresh processes each time their first retrieve of it (a hit from the server: exact
   bytes), then warm hits of their own, and exit. The first (``restart``) waits, after building
   its engine and before that retrieve, until the cache tier reports its link connected and its
   arena mapping prepared (at most 2 s: a real engine loads its weights for seconds between the
   two, while the tier connects and pre-faults in the background); its median against the warm
   hits before each restart is the goal (<= ``GOAL_RESTART``). The second (``restart-cold``)
   retrieves at once, connect and page faults included: reported beside it, no goal. Then an
   in-process CPU tier the same way: its first retrieve after a restart is a miss (0 tokens).

``KVLAYER_SMOKE=1`` shrinks the run to the ``tiny`` preset, 1 MiB, 512 restart tokens, one round
and one restart. Run: ``kvlayer bench cache-server [--mib 48] [--restart-tokens 8192] --json cs.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvlayer.benchmarks.common import machine_info, positive_int, print_table, progress, settings_of, write_json

if TYPE_CHECKING:
    from kvlayer.benchmarks.tier_engine import PagedSequence
    from kvlayer.cache_engine import KVCacheEngine

GOAL_RETRIEVE = 1.15
"""Server retrieve time over in-process CPU tier retrieve time, at most."""
GOAL_RESTART = 1.2
"""First retrieve after a restart over the warm hit before it, at most."""
PRESET_NAMES = ("bench", "small", "tiny")
SIDES = ("cache", "cpu")
"""The server's tier and the in-process CPU tier, in the order each round runs them."""
WORKER = "kvlayer.benchmarks.cache_server_worker"
Run = Callable[[], object]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench cache-server`` (``--model`` and ``--device`` are not used)."""
    p.add_argument("--preset", default="bench", choices=PRESET_NAMES, help="model preset whose KV layout is stored")
    p.add_argument("--mib", type=positive_int, default=48,
                   help="MiB of the prefix of figure 1, rounded down to whole chunks (at least one)")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk (chunk_size)")
    p.add_argument("--repeat", type=positive_int, default=9, help="timed rounds of figure 1; warm hits per process")
    p.add_argument("--restart-tokens", type=positive_int, default=8192,
                   help="tokens of the prefix of figure 2, rounded down to whole chunks (at least one)")
    p.add_argument("--restarts", type=positive_int, default=3, help="fresh engine processes timed after the store")


def main(args: argparse.Namespace) -> int:
    """Measure both figures, print the tables and goal lines, write ``--json``; 0 on success
    (RuntimeError if a side gives back fewer tokens or other bytes than it stored)."""
    notes: list[str] = []
    if os.environ.get("KVLAYER_SMOKE") == "1":  # the docs' smoke runs: the documented command, tiny sizes
        args = argparse.Namespace(**{**vars(args), "preset": "tiny", "mib": 1, "repeat": 1, "restarts": 1,
                                     "chunk_tokens": min(args.chunk_tokens, 64),
                                     "restart_tokens": min(args.restart_tokens, 512)})
        notes.append("KVLAYER_SMOKE=1: tiny preset, 1 MiB, at most 512 restart tokens, one round, one restart")
    from kvlayer.benchmarks.cache_server_worker import bench_layout
    from kvlayer.benchmarks.tier_engine import PagedSequence

    layout = bench_layout(args.preset)
    chunk = args.chunk_tokens
    tokens = max(chunk, args.mib * 2**20 // layout.chunk_bytes(1) // chunk * chunk)
    restart_tokens = max(chunk, args.restart_tokens // chunk * chunk)
    capacity = layout.chunk_bytes(tokens + restart_tokens + 2 * chunk)
    steps = args.repeat + 1 + 2 * args.restarts + 3
    with tempfile.TemporaryDirectory(prefix="kvcs-bench-") as folder, \
            server_process(os.path.join(folder, "cache.sock"), capacity) as sock, \
            progress(steps, "bench cache-server") as advance:
        seq = PagedSequence.random(layout, tokens)
        retrieve = measure_retrieve(seq, chunk, sock, args.repeat, advance)
        del seq
        restart = measure_restart(args.preset, chunk, restart_tokens, args.repeat, args.restarts, sock, advance)
        server = server_stats(sock)
    record = {"machine": machine_info("cpu"), "model": _model(args.preset), "settings": settings_of(args),
              "goals": {"retrieve_ratio": GOAL_RETRIEVE, "restart_ratio": GOAL_RESTART}, "notes": notes,
              "server": {"capacity_bytes": capacity, **server}, "retrieve": retrieve, "restart": restart}
    _print(args, record)
    write_json(args.json, record)
    return 0


# --- the server -----------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    """This process's environment without ``KVLAYER_*`` variables: the children get their
    settings from their command lines only."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}


@contextlib.contextmanager
def server_process(socket_path: str, capacity: int) -> Iterator[str]:
    """A ``kvlayer cache-server`` of ``capacity`` bytes on ``socket_path`` while the context lasts
    (its socket path yielded once it listens); stopped with SIGTERM at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "kvlayer.cli", "cache-server", "--socket", socket_path,
                             "--cpu-capacity", str(capacity)], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if "listening on" not in line:
            proc.kill()
            rest = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the cache server did not start: {(line + rest).strip()[-2000:]}")
        yield socket_path
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def server_stats(socket_path: str) -> dict[str, int]:
    """The running server's accounting (``STATS``), epoch left out."""
    from kvlayer.cacheserver.sync_client import SyncClient

    with SyncClient(socket_path) as client:
        return {k: v for k, v in client.stats()._asdict().items() if k != "epoch"}


# --- figure 1: one prefix, server against in-process ----------------------------------------
def measure_retrieve(seq: PagedSequence, chunk_tokens: int, socket_path: str, repeat: int,
                     advance: Callable[[int], None]) -> dict[str, Any]:
    """Figure 1 (module docstring) for ``seq``: per op, each side's runs, median and best, and the
    ratios server / in-process. RuntimeError if a side does not give ``seq`` back exact."""
    from kvlayer.benchmarks.cache_server_worker import MODEL, exact, target_config
    from kvlayer.benchmarks.tier_ceilings import alternated_times
    from kvlayer.cache_engine import KVCacheEngine

    with contextlib.ExitStack() as stack:
        engines = {side: stack.enter_context(KVCacheEngine(target_config(side, seq.layout, chunk_tokens, seq.nbytes,
                                                                         socket_path), seq.layout, model_name=MODEL))
                   for side in SIDES}
        checks = {}
        for side, engine in engines.items():
            _store(engine, seq)()
            for cache in seq.dst:
                cache.zero_()
            _retrieve(engine, seq)()
            if not exact(seq):
                raise RuntimeError(f"the {side} tier gave back other bytes than it stored")
            checks[side] = {"exact": True, "hit_tokens": _hit_tokens(engine, side), "tiers": engine.tier_names}
        runs = {(op, side): (fn(engines[side], seq), _remover(engines[side], seq) if op == "store" else None)
                for op, fn in (("retrieve", _retrieve), ("store", _store)) for side in SIDES}
        times = alternated_times(runs, repeat)
        advance(repeat + 1)
    ops = {op: _compare({side: times[op, side] for side in SIDES}, GOAL_RETRIEVE if op == "retrieve" else None,
                        seq.nbytes) for op in ("retrieve", "store")}
    return {"tokens": len(seq.token_ids), "kv_bytes": seq.nbytes, "chunk_tokens": chunk_tokens,
            "block_size": seq.layout.block_size, "checks": checks, "ops": ops}


def _retrieve(engine: KVCacheEngine, seq: PagedSequence) -> Run:
    def run() -> None:
        n = engine.retrieve(seq.token_ids, seq.dst, seq.slots)
        if n != len(seq.token_ids):
            raise RuntimeError(f"retrieve gave back {n} of {len(seq.token_ids)} tokens")
    return run


def _store(engine: KVCacheEngine, seq: PagedSequence) -> Run:
    chunks = len(engine.keys(seq.token_ids))

    def run() -> None:
        n = engine.store(seq.token_ids, seq.src, seq.slots)
        engine.flush(timeout=600)
        if n != chunks:
            raise RuntimeError(f"store took {n} of {chunks} chunks")
    return run


def _remover(engine: KVCacheEngine, seq: PagedSequence) -> Run:
    """Remove the sequence's chunks until a lookup finds none: the server drops a chunk only once
    its last lease is back, and a retrieve's releases reach it just after the retrieve returns."""
    keys = engine.keys(seq.token_ids)

    def run() -> None:
        deadline = time.monotonic() + 10
        while True:
            engine.remove(keys)
            if engine.lookup(seq.token_ids, record=False).num_tokens == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the stored chunks could not be removed within 10 s")
            time.sleep(0.001)
    return run


def _hit_tokens(engine: KVCacheEngine, tier: str) -> int:
    return int(engine.stats()["tiers"].get(tier, {}).get("hit_tokens", 0))


def summary(runs: list[float]) -> dict[str, Any]:
    """``runs`` with their median and best (shortest)."""
    return {"runs_s": runs, "median_s": statistics.median(runs), "best_s": min(runs)}


def _compare(sides: dict[str, list[float]], goal: float | None, nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {side: {**summary(runs), "gib_s": nbytes / statistics.median(runs) / 2**30}
                           for side, runs in sides.items()}
    ratio = out["cache"]["median_s"] / out["cpu"]["median_s"]
    out.update(ratio=ratio, best_ratio=out["cache"]["best_s"] / out["cpu"]["best_s"], goal=goal,
               goal_met=None if goal is None else ratio <= goal)
    return out


# --- figure 2: a restart --------------------------------------------------------------------
def run_worker(target: str, mode: str, preset: str, chunk_tokens: int, tokens: int, repeat: int,
               socket_path: str) -> dict[str, Any]:
    """One engine process of ``cache_server_worker`` to its end; its JSON line (RuntimeError,
    with its output, if it fails)."""
    argv = [sys.executable, "-m", WORKER, target, mode, preset, str(chunk_tokens), str(tokens), str(repeat),
            socket_path]
    out = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{target} {mode} worker failed ({out.returncode}): {(out.stdout + out.stderr)[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_restart(preset: str, chunk_tokens: int, tokens: int, repeat: int, restarts: int, socket_path: str,
                    advance: Callable[[], None]) -> dict[str, Any]:
    """Figure 2 (module docstring): the server's first retrieves after ``restarts`` restarts
    against the warm hits before each, and the in-process CPU tier's first retrieve after one.
    RuntimeError if a server-side first retrieve is not a full, exact hit."""
    def worker(target: str, mode: str) -> dict[str, Any]:
        out = run_worker(target, mode, preset, chunk_tokens, tokens, repeat, socket_path)
        advance()
        return out

    procs = [worker("cache", "store")] + [worker("cache", mode) for _ in range(restarts)
                                          for mode in ("restart", "restart-cold")]
    for p in procs[1:]:
        if p["first_tokens"] != tokens or p["first_hit_tokens"] != tokens or not p["exact"]:
            raise RuntimeError(f"a restarted engine's first retrieve was not a full hit from the server: {p}")
    before = summary([s for p in procs[:-1] for s in p["hits_s"]])
    ready = [p for p in procs[1:] if p["mode"] == "restart"]
    first = summary([p["first_s"] for p in ready])
    cold = summary([p["first_s"] for p in procs[1:] if p["mode"] == "restart-cold"])
    cpu_store, cpu_restart = worker("cpu", "store"), worker("cpu", "restart")
    ratio = first["median_s"] / before["median_s"]
    return {"tokens": tokens, "chunk_tokens": chunk_tokens, "processes": procs,
            "cache": {"before": before, "first": first, "first_tokens": [p["first_tokens"] for p in procs[1:]],
                      "ready_s": [p["ready_s"] for p in ready], "ready": all(p["ready"] for p in ready),
                      "first_cold": cold, "cold_ratio": cold["median_s"] / before["median_s"],
                      "ratio": ratio, "best_ratio": first["best_s"] / before["best_s"], "goal": GOAL_RESTART,
                      "goal_met": ratio <= GOAL_RESTART},
            "cpu": {"before": summary(cpu_store["hits_s"]), "first_s": cpu_restart["first_s"],
                    "first_tokens": cpu_restart["first_tokens"], "processes": [cpu_store, cpu_restart]}}


# --- output ---------------------------------------------------------------------------------
def _model(preset: str) -> dict[str, Any]:
    from kvlayer.engine.presets import PRESETS

    spec = PRESETS[preset]
    return {"name": preset, "preset": preset, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": "float32"}


def goal_lines(record: dict[str, Any]) -> list[str]:
    """One line per goal: ``retrieve through the server 1.08x in-process (goal <= 1.15): met``
    (the restart's: with the link ready, ``measure_restart``)."""
    ret, cache = record["retrieve"]["ops"]["retrieve"], record["restart"]["cache"]
    return [f"retrieve through the server {ret['ratio']:.2f}x in-process (goal <= {GOAL_RETRIEVE:.2f}): "
            f"{'met' if ret['goal_met'] else 'NOT met'}",
            f"first retrieve after a restart, link ready, {cache['ratio']:.2f}x the hit before it "
            f"(goal <= {GOAL_RESTART:.2f}): "
            f"{'met' if cache['goal_met'] else 'NOT met'}"]


def _print(args: argparse.Namespace, record: dict[str, Any]) -> None:
    ret, rs = record["retrieve"], record["restart"]
    rows = [[op, 1e3 * r["cache"]["median_s"], 1e3 * r["cache"]["best_s"], r["cache"]["gib_s"],
             1e3 * r["cpu"]["median_s"], 1e3 * r["cpu"]["best_s"], r["cpu"]["gib_s"], r["ratio"], r["best_ratio"],
             "-" if r["goal"] is None else f"<= {r['goal']}"] for op, r in ret["ops"].items()]
    print_table(f"bench cache-server: one prefix of {ret['tokens']} tokens ({ret['kv_bytes'] / 2**20:.1f} MiB, "
                f"'{args.preset}' preset, float32, random slots), through the server vs an in-process CPU tier, "
                f"alternated, {args.repeat} rounds",
                ["op", "server ms", "best", "GiB/s", "in-process ms", "best", "GiB/s", "ratio", "best ratio", "goal"],
                rows)
    cache, cpu = rs["cache"], rs["cpu"]
    n = len(cache["first"]["runs_s"])
    rows = [["server", "hit before restart", 1e3 * cache["before"]["median_s"], 1e3 * cache["before"]["best_s"],
             rs["tokens"], "-"],
            ["server", f"first retrieve after restart, link ready (x{n})", 1e3 * cache["first"]["median_s"],
             1e3 * cache["first"]["best_s"], min(cache["first_tokens"]), f"{cache['ratio']:.2f}"],
            ["server", f"first retrieve after restart, no wait (x{n})", 1e3 * cache["first_cold"]["median_s"],
             1e3 * cache["first_cold"]["best_s"], min(cache["first_tokens"]), f"{cache['cold_ratio']:.2f}"],
            ["in-process cpu", "hit before restart", 1e3 * cpu["before"]["median_s"], 1e3 * cpu["before"]["best_s"],
             rs["tokens"], "-"],
            ["in-process cpu", "first retrieve after restart", 1e3 * cpu["first_s"], 1e3 * cpu["first_s"],
             cpu["first_tokens"], "-"]]
    print_table(f"bench cache-server: an engine restarted, a prefix of {rs['tokens']} tokens, each engine a new "
                f"process",
                ["tier", "retrieve", "ms", "best ms", "tokens", "ratio"], rows)
    for note in record["notes"]:
        print(f"note: {note}")
    for line in goal_lines(record):
        print(line)
