"""``kvlayer bench peer``: kvlayer's ``KVCacheEngine`` against LMCache 0.5.6's ``LMCacheEngine``, side by side.

Optional and out of CI. LMCache pins protobuf 6 (kvlayer needs 7), so it lives in a venv of its
own (``--venv``, default ``~/.cache/kvlayer/peer-venv``), built on first use: ``python -m venv``,
the local CPU ``torch==2.13.0``, ``lmcache==0.5.6`` without its dependencies (its pins pull CUDA
torch, cupy and cuda-python), then the few packages its CPU path imports (``PEER_DEPS``). Each
step is printed; one that fails is a one-line error (exit 2).

Both sides get the same paged KV: ``--tokens`` tokens (48 MiB for the ``bench`` layout, float32)
at the random block-table slots of ``bench tiers``'s engine rows (``tier_engine.PagedSequence``).
The LMCache side is ``peer_lmcache_side.py`` run in that venv, reading the caches and slots as
raw bytes from a file (no pickle) and answering JSON lines. Per tier (cpu; nvme: LMCache's
local disk backend; redis: its redis remote backend, on a throwaway redis-server unless
``--redis-url``), ``--repeat`` rounds after an untimed warm-up round alternate: kvlayer
retrieve, LMCache retrieve, (cpu) the raw scatter ceiling, kvlayer durable store (store +
flush into the emptied tier), LMCache durable store (store, then its lookup polled until every
chunk is in the tier). Exactness: each side's retrieved KV equals the stored KV at every slot.

Run: ``kvlayer bench peer [--repeat 5] [--tiers cpu,nvme,redis] --json peer.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.common import machine_info, nonnegative_int, positive_int, print_table, settings_of, write_json

TIERS = ("cpu", "nvme", "redis")
LMCACHE = "lmcache==0.5.6"
TORCH = "torch==2.13.0"
PEER_DEPS = ("numpy<=2.2.6", "pyyaml", "redis", "msgspec", "psutil", "prometheus_client<=0.24.1", "sortedcontainers",
             "blake3", "aiofiles", "aiofile", "pyzmq", "py-cpuinfo", "safetensors", "cachetools", "numba", "aiohttp",
             "requests", "transformers", "cryptography")
"""What LMCache 0.5.6's CPU path imports (found by importing ``lmcache.v1.cache_engine`` until it loads)."""
GOALS = {"cpu_retrieve_speedup": 1.5, "cpu_retrieve_of_scatter": 0.7, "lower_retrieve_speedup": 2.0,
         "store_speedup": 1.5}
"""Issue 24's goals: speedups are LMCache's median time over kvlayer's."""
SIDE = Path(__file__).with_name("peer_lmcache_side.py")
SETTLE_S = 0.05
"""The pause before each timed op, either side: torch's OpenMP workers spin for several ms after
a parallel op, and one process's spinning workers would otherwise run into the other's timing."""


class PeerBuildError(ValueError):
    """The LMCache venv could not be built (one line: the step and its last output line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvlayer bench peer`` (``--model`` and ``--device`` are not used)."""
    from kvlayer.benchmarks.tiers import _names_of

    p.add_argument("--repeat", type=positive_int, default=5, help="alternations (rounds) per figure")
    p.add_argument("--tiers", type=_names_of(TIERS, "tier"), default=list(TIERS), help=f"of {list(TIERS)}")
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens of the paged KV (whole chunks)")
    p.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per chunk, both sides")
    p.add_argument("--venv", default=str(Path.home() / ".cache" / "kvlayer" / "peer-venv"),
                   help="the LMCache venv (built here if it does not import lmcache)")
    p.add_argument("--nvme-path", help="folder for both sides' disk tiers (default: a temporary one under --home)")
    p.add_argument("--redis-url", help="Redis server (default: a local redis-server; no redis rows without one)")
    p.add_argument("--torch-threads", type=nonnegative_int, default=0, help="torch threads, both sides (0: default)")


def ensure_venv(venv: Path, python: str = sys.executable, say: Callable[[str], None] = print) -> Path:
    """The venv's python, building the venv first unless it already imports LMCache 0.5.6.
    PeerBuildError (one line) when a step fails."""
    exe = venv / "bin" / "python"
    if exe.exists() and _imports_lmcache(exe):
        return exe
    pip = [str(exe), "-m", "pip", "install", "-q"]
    steps = [("create the venv", [python, "-m", "venv", str(venv)]),
             (f"install {TORCH} (the local CPU build)", [*pip, TORCH]),
             (f"install {LMCACHE} without its pins", [*pip, "--no-deps", LMCACHE]),
             ("install what LMCache's CPU path imports", [*pip, *PEER_DEPS])]
    for what, cmd in steps:
        say(f"bench peer: {what}: {' '.join(cmd)}")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerBuildError(f"cannot build the LMCache venv at {venv}: {what} failed: {e}") from None
        if done.returncode:
            raise PeerBuildError(f"cannot build the LMCache venv at {venv}: {what} failed: {_last_line(done)}")
    if not _imports_lmcache(exe):
        raise PeerBuildError(f"cannot build the LMCache venv at {venv}: lmcache.v1.cache_engine does not import")
    return exe


def _imports_lmcache(exe: Path) -> bool:
    code = "import lmcache.v1.cache_engine, importlib.metadata as m; assert m.version('lmcache') == '0.5.6'"
    return subprocess.run([str(exe), "-c", code], capture_output=True, timeout=300).returncode == 0


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
    return lines[-1].strip() if lines else f"exit {done.returncode}"


def main(args: argparse.Namespace) -> int:
    """Build the venv, measure, print the table, write ``--json``; 0 on success."""
    import torch

    from kvlayer.benchmarks.tiers import _nvme_folder, _redis_url

    if args.tokens % args.chunk_tokens:
        raise ValueError(f"--tokens {args.tokens} is not a multiple of --chunk-tokens {args.chunk_tokens}")
    exe = ensure_venv(Path(args.venv).expanduser())
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    notes: list[str] = []
    tiers = list(args.tiers)
    with _redis_url(args.redis_url if "redis" in tiers else None, "redis" in tiers, notes) as url, \
            _nvme_folder(args.nvme_path, args.home) as folder:
        tiers = [t for t in tiers if t != "redis" or url]
        results = measure_tiers(exe, args, tiers, folder, url)
    record = {"machine": machine_info("cpu"), "settings": settings_of(args), "goals": GOALS, "notes": notes,
              **results}
    print_peer(record)
    write_json(args.json, record)
    return 0


def measure_tiers(exe: Path, args: argparse.Namespace, tiers: list[str], folder: str,
                  url: str | None) -> dict[str, Any]:
    """The rows of every tier in ``tiers``, both sides on one ``PagedSequence`` of the ``bench`` layout;
    RuntimeError if either side fails."""
    import torch

    from kvlayer.benchmarks.tier_ceilings import BLOCK_SIZE
    from kvlayer.benchmarks.tier_engine import PagedSequence
    from kvlayer.engine.presets import PRESETS
    from kvlayer.layout import KVLayout

    preset = PRESETS["bench"]
    layout = KVLayout(preset.num_layers, preset.num_kv_heads, preset.head_dim, torch.float32, BLOCK_SIZE)
    seq = PagedSequence.random(layout, args.tokens)
    kv_file = Path(folder) / "peer-kv.bin"
    with open(kv_file, "wb") as f:  # raw float32 caches, then the int64 slots: the side maps them
        for cache in seq.src:
            f.write(cache.contiguous().numpy().tobytes())
        f.write(seq.slots.to(torch.int64).numpy().tobytes())
    spec = {"layers": layout.num_layers, "heads": layout.num_kv_heads, "dim": layout.head_dim,
            "block_size": BLOCK_SIZE, "blocks": seq.src[0].shape[1], "tokens": args.tokens,
            "chunk_tokens": args.chunk_tokens, "kv_file": str(kv_file), "token_ids": seq.token_ids,
            "capacity_bytes": (args.repeat + 3) * seq.nbytes, "threads": torch.get_num_threads()}
    rows: list[dict[str, Any]] = []
    exact: dict[str, dict[str, bool]] = {}
    with side_process(exe, SIDE, spec) as ask:
        version = ask({"cmd": "version"})["lmcache"]
        for tier in tiers:
            tier_rows, exact[tier] = _measure_tier(tier, seq, args, folder, url, ask)
            rows += tier_rows
    kv_file.unlink(missing_ok=True)
    return {"lmcache": version, "tokens": args.tokens, "kv_mib": seq.nbytes / 2**20, "repeat": args.repeat,
            "chunk_tokens": args.chunk_tokens, "rows": rows, "exact": exact}


def _measure_tier(tier: str, seq: Any, args: argparse.Namespace, folder: str, url: str | None,
                  ask: Callable[[dict[str, Any]], Any]) -> tuple[list[dict[str, Any]], dict[str, bool]]:
    """The retrieve and store rows of ``tier``, ``--repeat`` alternations after a warm-up round, and
    each side's exactness (checked after the warm-up and after the last round)."""
    import time

    from kvlayer.benchmarks.tier_ceilings import scatter_runs
    from kvlayer.benchmarks.tier_engine import engine_config
    from kvlayer.cache_engine import KVCacheEngine

    config = engine_config(tier, seq.layout, args.chunk_tokens, seq.nbytes, folder, url)
    scatters = scatter_runs(seq.dst, seq.slots, seq.kv) if tier == "cpu" else {}
    times: dict[str, list[float]] = {k: [] for k in ("retrieve", "lm_retrieve", "store", "lm_store", *scatters)}
    exact = {"kvlayer": True, "lmcache": True}

    def timed(run: Callable[[], object]) -> float:
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    def lm(cmd: dict[str, Any]) -> Any:
        time.sleep(SETTLE_S)
        return ask(cmd)

    with KVCacheEngine(config, seq.layout, model_name="bench-peer") as engine:
        keys = engine.keys(seq.token_ids)

        def store() -> None:
            if engine.store(seq.token_ids, seq.src, seq.slots) != len(keys) or not engine.flush(timeout=600):
                raise RuntimeError(f"kvlayer's {tier} store did not take every chunk")

        def retrieve() -> None:
            if engine.retrieve(seq.token_ids, seq.dst, seq.slots) != len(seq.token_ids):
                raise RuntimeError(f"kvlayer's {tier} retrieve missed tokens")

        ask({"cmd": "open", "tier": tier, "disk": str(Path(folder) / f"lmcache-{tier}"), "url": url or ""})
        try:
            for i in range(args.repeat + 1):  # round 0 warms up, untimed, and is checked
                engine.evict_all()
                took = {"store": timed(store), "lm_store": lm({"cmd": "store", "round": i})["seconds"]}
                for cache in seq.dst:
                    cache.zero_()
                took["retrieve"] = timed(retrieve)
                if i in (0, args.repeat):
                    exact["kvlayer"] &= seq.retrieved()
                answer = lm({"cmd": "retrieve"})
                if answer["tokens"] != len(seq.token_ids):
                    raise RuntimeError(f"LMCache's {tier} retrieve gave {answer['tokens']} tokens")
                took["lm_retrieve"] = answer["seconds"]
                if i in (0, args.repeat):
                    exact["lmcache"] &= bool(ask({"cmd": "check"})["exact"])
                took.update({name: timed(run) for name, run in scatters.items()})
                for name, seconds in took.items():
                    if i:
                        times[name].append(seconds)
        finally:
            ask({"cmd": "close"})
            engine.evict_all()
    scatter = min(scatters, key=lambda n: statistics.median(times[n])) if scatters else None
    rows = [row(tier, "retrieve", {"kvlayer": times["retrieve"], "lmcache": times["lm_retrieve"],
                                   "scatter": times[scatter] if scatter else []}),
            row(tier, "store", {"kvlayer": times["store"], "lmcache": times["lm_store"]})]
    return rows, exact


def print_peer(record: dict[str, Any]) -> None:
    """The side-by-side table of ``record`` (``measure_tiers``'s, or a saved ``--json``), then the goal lines."""
    cols = ["tier", "op", "kvlayer ms", "best", "LMCache ms", "best", "speedup", "scatter ms", "of scatter",
            "exact"]
    rows = []
    for r in record["rows"]:
        scatter = r.get("scatter_s")
        rows.append([r["tier"], r["op"], 1e3 * r["kvlayer_s"], 1e3 * min(r["kvlayer_runs_s"]), 1e3 * r["lmcache_s"],
                     1e3 * min(r["lmcache_runs_s"]), r["speedup"], None if scatter is None else 1e3 * scatter,
                     r.get("of_scatter"), _exact(record["exact"][r["tier"]])])
    print_table(f"bench peer: kvlayer vs LMCache {record.get('lmcache', '0.5.6')}, {record['kv_mib']:.0f} MiB of "
                f"paged KV ({record['tokens']} tokens, float32) at random slots, median and best of "
                f"{record['repeat']} alternations (speedup: LMCache's median over kvlayer's)", cols, rows)
    for note in record.get("notes", []):
        print(f"note: {note}")
    for line in goal_lines(record):
        print(line)


def _exact(sides: dict[str, bool]) -> str:
    return "both" if all(sides.values()) else ",".join(f"{k} NOT" for k, v in sides.items() if not v)


def goal_lines(record: dict[str, Any]) -> list[str]:
    """One line per goal of issue 24 that the rows allow judging, ``... : met`` or ``NOT met``."""
    lines = []
    for r in record["rows"]:
        if r["op"] == "retrieve":
            goal = GOALS["cpu_retrieve_speedup"] if r["tier"] == "cpu" else GOALS["lower_retrieve_speedup"]
        else:
            goal = GOALS["store_speedup"]
        lines.append(_goal(f"{r['tier']} {r['op']}: {r['speedup']:.2f}x LMCache's", r["speedup"], goal, "x"))
        if r.get("of_scatter") is not None:
            lines.append(_goal(f"cpu retrieve: {r['of_scatter']:.2f} of the raw scatter", r["of_scatter"],
                               GOALS["cpu_retrieve_of_scatter"], ""))
    return lines


def _goal(text: str, value: float, goal: float, unit: str) -> str:
    return f"{text} (goal >= {goal:.2f}{unit}): {'met' if value >= goal else 'NOT met'}"


def row(tier: str, op: str, times: dict[str, list[float]]) -> dict[str, Any]:
    """One table row from the rounds' wall times of ``kvlayer``, ``lmcache`` and (optional) ``scatter``."""
    ours, theirs = statistics.median(times["kvlayer"]), statistics.median(times["lmcache"])
    out: dict[str, Any] = {"tier": tier, "op": op, "kvlayer_s": ours, "kvlayer_runs_s": times["kvlayer"],
                           "lmcache_s": theirs, "lmcache_runs_s": times["lmcache"], "speedup": theirs / ours}
    if times.get("scatter"):
        out["scatter_s"] = statistics.median(times["scatter"])
        out["scatter_runs_s"] = times["scatter"]
        out["of_scatter"] = out["scatter_s"] / ours
    return out


@contextlib.contextmanager
def side_process(exe: Path, side: Path, spec: dict[str, Any]) -> Iterator[Callable[[dict[str, Any]], Any]]:
    """The LMCache side running in its venv; yields ``ask(command) -> answer`` (RuntimeError for
    an answered error or a side that died)."""
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    (work / "spec.json").write_text(json.dumps(spec))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        log = stack.enter_context(open(work / "side.log", "w+"))
        proc = subprocess.Popen([str(exe), str(side), str(work / "spec.json")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                env={"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
        stack.callback(_stop, proc)

        def ask(cmd: dict[str, Any]) -> Any:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
            return _answer(proc.stdout.readline(), cmd, log)

        assert proc.stdout is not None
        _answer(proc.stdout.readline(), {"cmd": "start"}, log)
        yield ask


def _stop(proc: subprocess.Popen[str]) -> None:
    """Ask the side to quit; kill it if it has not within 30 s."""
    if proc.poll() is None and proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answer(line: str, cmd: dict[str, Any], log: Any) -> Any:
    if not line:
        log.seek(0)
        tail = " | ".join(log.read().strip().splitlines()[-3:])
        raise RuntimeError(f"the LMCache side died at {cmd['cmd']}: {tail}")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"the LMCache side failed at {cmd}: {answer['error']}")
    return answer
