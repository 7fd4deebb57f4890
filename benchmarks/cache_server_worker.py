"""One engine process of ``kvlayer bench cache-server`` (``kvlayer.benchmarks.cache_server_bench``).

``python -m kvlayer.benchmarks.cache_server_worker TARGET MODE PRESET CHUNK TOKENS REPEAT SOCKET``
builds a ``KVCacheEngine`` whose only tier is TARGET (``cache``: the server at SOCKET,
``cpu_capacity: 0``; ``cpu``: an in-process CPU tier, SOCKET unused), holding ``PagedSequence.random(layout,
TOKENS)`` (the same tokens and KV in every process: the seed is fixed), and prints one JSON line:

- ``store``: stores the sequence (store + flush), checks that a retrieve gives it back exact, then
  times REPEAT warm retrieves (``hits_s``): the hit time before a restart.
- ``restart``: a fresh process's first retrieve of the sequence, timed (``first_s``,
  ``first_tokens``); its bytes are checked, then (on a hit) REPEAT warm retrieves are timed.
  Before it, as a real engine loading its weights would, the worker waits until the ``cache``
  tier reports its link connected and its mapping prepared (the tier does both in the
  background from the engine's construction), at most ``READY_WAIT_S`` (``ready_s``: how long,
  ``ready``: whether it got there).
- ``restart-cold``: the same with no wait: the first call on the engine is the retrieve, so the
  connect (and the page faults of a fresh mapping) are part of ``first_s``.

The engine's caches and the sequence are built before anything is timed. Bytes are compared
exactly (``exact``: int32 views, so ``-0.0`` and ``0.0`` differ).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from kvlayer.benchmarks.tier_engine import PagedSequence, engine_config
from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import KVLayerConfig
from kvlayer.layout import KVLayout

BLOCK_SIZE = 16
MODEL = "bench-cache-server"
TARGETS = ("cache", "cpu")
RESTART_MODES = ("restart", "restart-cold")
READY_WAIT_S = 2.0
"""The most a ``restart`` worker waits for the cache tier's link before its first retrieve."""


def bench_layout(preset: str) -> KVLayout:
    """The ``preset`` model's KV layout in float32, blocks of ``BLOCK_SIZE`` tokens."""
    from kvlayer.engine.presets import PRESETS

    spec = PRESETS[preset]
    return KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, BLOCK_SIZE)


def target_config(target: str, layout: KVLayout, chunk_tokens: int, nbytes: int, socket_path: str) -> KVLayerConfig:
    """The configuration whose only tier is ``target`` (``cache`` or ``cpu``), sized for ``nbytes``
    of KV, as ``bench tiers`` sizes its CPU rows (deadlines out of the way)."""
    config = engine_config("cpu", layout, chunk_tokens, nbytes, "", None)
    if target == "cpu":
        return config
    if target != "cache":
        raise ValueError(f"unknown target {target!r}; choose from {list(TARGETS)}")
    values = {f: getattr(config, f) for f in ("chunk_size", "tier_timeout_ms", "staging_capacity")}
    return KVLayerConfig(**values, cpu_capacity=0, cache_server=socket_path)


def exact(seq: PagedSequence, n: int | None = None) -> bool:
    """Whether ``seq.dst`` holds ``seq.src``'s bytes at the first ``n`` slots (all if None)."""
    at = seq.slots[: len(seq.slots) if n is None else n]

    def rows(cache: torch.Tensor) -> torch.Tensor:
        return cache.view(2, -1, seq.layout.num_kv_heads, seq.layout.head_dim)[:, at].view(torch.int32)

    return all(torch.equal(rows(d), rows(s)) for d, s in zip(seq.dst, seq.src))


def retrieve_once(engine: KVCacheEngine, seq: PagedSequence) -> tuple[float, int]:
    """The wall seconds of one ``retrieve`` of the whole sequence, and the tokens it gave back."""
    start = time.perf_counter()
    n = engine.retrieve(seq.token_ids, seq.dst, seq.slots)
    return time.perf_counter() - start, n


def warm_hits(engine: KVCacheEngine, seq: PagedSequence, repeat: int) -> list[float]:
    """The wall seconds of ``repeat`` retrieves of the whole sequence, each a full hit."""
    out = []
    for _ in range(repeat):
        seconds, n = retrieve_once(engine, seq)
        if n != len(seq.token_ids):
            raise RuntimeError(f"a warm retrieve gave back {n} of {len(seq.token_ids)} tokens")
        out.append(seconds)
    return out


def hit_tokens(engine: KVCacheEngine, tier: str) -> int:
    """The tokens ``tier`` has counted as hits in this process (0 when it is not a tier here)."""
    return int(engine.stats()["tiers"].get(tier, {}).get("hit_tokens", 0))


def wait_ready(engine: KVCacheEngine, target: str, limit: float = READY_WAIT_S) -> tuple[float, bool]:
    """Wait until ``target`` (``cache``) reports a connected link with its mapping prepared, at
    most ``limit`` seconds; the seconds waited and whether it got there (other tiers: at once)."""
    start = time.perf_counter()
    while True:
        backend = engine.stats()["tiers"].get(target, {}).get("backend", {})
        ready = target != "cache" or (backend.get("connects", 0) >= 1 and backend.get("mapped", 0) == 1)
        waited = time.perf_counter() - start
        if ready or waited >= limit:
            return waited, ready
        time.sleep(0.001)


def run(target: str, mode: str, preset: str, chunk_tokens: int, tokens: int, repeat: int,
        socket_path: str) -> dict[str, Any]:
    """One worker's figures (see the module docstring); RuntimeError on a stored or retrieved
    sequence that is short or not exact."""
    layout = bench_layout(preset)
    seq = PagedSequence.random(layout, tokens)
    config = target_config(target, layout, chunk_tokens, seq.nbytes, socket_path)
    with KVCacheEngine(config, layout, model_name=MODEL) as engine:
        if mode == "store":
            stored = engine.store(seq.token_ids, seq.src, seq.slots)
            engine.flush(timeout=600)
            seconds, n = retrieve_once(engine, seq)
            if n != tokens or not exact(seq):
                raise RuntimeError(f"the {target} tier gave back {n} of {tokens} tokens, or altered KV")
            return {"target": target, "mode": mode, "stored_chunks": stored, "tokens": tokens,
                    "exact": True, "hits_s": warm_hits(engine, seq, repeat)}
        if mode not in RESTART_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {['store', *RESTART_MODES]}")
        ready_s, ready = wait_ready(engine, target) if mode == "restart" else (0.0, False)
        first_s, n = retrieve_once(engine, seq)
        ok = exact(seq, n)
        if not ok:
            raise RuntimeError(f"the {target} tier gave back altered KV after a restart")
        return {"target": target, "mode": mode, "tokens": tokens, "ready_s": ready_s, "ready": ready,
                "first_s": first_s, "first_tokens": n,
                "first_hit_tokens": hit_tokens(engine, target), "exact": ok,
                "hits_s": warm_hits(engine, seq, repeat) if n == tokens else []}


if __name__ == "__main__":
    target_, mode_, preset_, chunk_, tokens_, repeat_, socket_ = sys.argv[1:8]
    print(json.dumps(run(target_, mode_, preset_, int(chunk_), int(tokens_), int(repeat_), socket_)), flush=True)
