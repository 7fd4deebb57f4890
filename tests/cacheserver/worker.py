"""Client processes of the cache-server tests: ``python -m tests.cacheserver.worker MODE ARGS...``.

- ``store SOCK SALT`` / ``retrieve SOCK SALT OUT``: a ``KVCacheEngine`` that is a client of the
  server stores ``kv_caches(SEED)`` for ``TOKENS``, or retrieves them into zeroed caches and writes
  the retrieved rows' bytes to OUT; prints one JSON line (``tokens``).
- ``generate SOCK MODEL``: the bundled engine (float32) with ``kv_config={"cache_server": SOCK}``
  answers ``PROMPT`` greedily; prints ``{"tokens": [...], "external": N}``.
- ``hold SOCK N``: a raw protocol client stores N chunks, leases them, reserves N more without
  committing, prints ``holding`` and sleeps (to be killed).
- ``serve SOCK MODEL``: the bundled engine as in ``generate``; per line ``N`` on stdin it answers
  the next N requests (``SERVE_PROMPTS`` in turn, its prefix cache reset before each), one JSON
  line each (``tokens``, ``external``); ends at the end of stdin.
- ``churn SOCK``: a ``KVCacheEngine`` of ``BIG`` chunks (1 MiB each) removes, stores and retrieves
  ``BIG_TOKENS`` in a loop, printing ``looped`` after each round (to be killed mid-copy).
- ``soak SOCK SEED N``: N requests, each for one of ``SOAK_SEQS`` sequences picked at random
  (``SEED``): retrieve into zeroed caches, compare the hit rows with the sequence's own KV (a
  request whose rows differ is a bad hit), then store it; prints ``{"requests", "hit_tokens",
  "bad_hits"}``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

LAYOUT_ARGS = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
NUM_BLOCKS = 64
CHUNK = 8
TOKENS = list(range(100, 140))  # 5 chunks of 8
SEED = 7
PROMPT = list(range(5, 70))  # 65 tokens: 4 chunks of 16 can be loaded
CHUNK_TOKENS = 16


def layout():
    from kvlayer import KVLayout

    return KVLayout(dtype=torch.float32, **LAYOUT_ARGS)


def kv_caches(seed: int | None) -> list[torch.Tensor]:
    """One paged cache per layer: random (from ``seed``) or zeros (``None``)."""
    shape = (2, NUM_BLOCKS, LAYOUT_ARGS["block_size"], LAYOUT_ARGS["num_kv_heads"], LAYOUT_ARGS["head_dim"])
    gen = torch.Generator().manual_seed(seed or 0)
    return [torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
            for _ in range(LAYOUT_ARGS["num_layers"])]


def slots(n: int, shift: int) -> torch.Tensor:
    """Token slots of ``n`` tokens starting at block ``shift`` (different in the two processes)."""
    return torch.arange(n) + shift * LAYOUT_ARGS["block_size"]


def rows(caches: list[torch.Tensor], at: torch.Tensor) -> bytes:
    """The KV of the tokens at slots ``at``, every layer, as bytes."""
    return torch.stack([c.view(2, -1, LAYOUT_ARGS["num_kv_heads"], LAYOUT_ARGS["head_dim"])[:, at]
                        for c in caches]).numpy().tobytes()


def kv_config(sock: str, salt: str = "") -> dict:
    return {"cache_server": sock, "cpu_capacity": 0, "chunk_size": CHUNK, "cache_salt": salt,
            "staging_capacity": "1MiB", "unhealthy_backoff_ms": 100, "unhealthy_backoff_max_ms": 200}


def _engine(sock: str, salt: str):
    from kvlayer import KVCacheEngine

    return KVCacheEngine(kv_config(sock, salt), layout(), model_name="m", model_fingerprint="f")


def store(sock: str, salt: str) -> dict:
    with _engine(sock, salt) as kv:
        return {"tokens": kv.store(TOKENS, kv_caches(SEED), slots(len(TOKENS), 0))}


def retrieve(sock: str, salt: str, out: str) -> dict:
    with _engine(sock, salt) as kv:
        dst, at = kv_caches(None), slots(len(TOKENS), 20)
        n = kv.retrieve(TOKENS, dst, at)
        with open(out, "wb") as f:
            f.write(rows(dst, at[:n]))
        return {"tokens": n, "held": kv.stats()["tiers"]["cache"]["backend"]["held"]}


def generate(sock: str, model: str) -> dict:
    from kvlayer.engine import LLM, SamplingParams

    config = {**kv_config(sock), "chunk_size": CHUNK_TOKENS}
    with LLM(model, num_gpu_blocks=64, dtype="float32", kv_config=config) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0,
                                                                           ignore_eos=True))[0]
        return {"tokens": list(out.outputs[0].token_ids), "external": out.num_external_tokens}


def hold(sock: str, n: int) -> None:
    import xxhash

    from kvlayer.cacheserver import protocol as wire
    from kvlayer.cacheserver.sync_client import SyncClient

    client = SyncClient(sock)
    keys = [wire.Key(bytes([i]) * 32, b"t" * 16) for i in range(2 * n)]
    client.reserve([(k, 4000) for k in keys[:n]])
    client.commit([(k.digest, xxhash.xxh3_64_intdigest(bytes(4000))) for k in keys[:n]])  # unwritten: zeros
    client.lease(keys[:n])
    client.reserve([(k, 4000) for k in keys[n:]])  # reserved, never committed: a store cut off
    print("holding", flush=True)
    time.sleep(600)


SERVE_PROMPTS = [list(range(5 + i, 70 + i)) for i in range(3)]
BIG = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 64, "block_size": 16}
BIG_TOKENS = list(range(1000, 1512))  # 8 chunks of 64 tokens, 1 MiB each
SOAK_SEQS = 60


def serve(sock: str, model: str) -> None:
    from kvlayer.engine import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    config = {**kv_config(sock), "chunk_size": CHUNK_TOKENS}
    i = 0
    with LLM(model, num_gpu_blocks=64, dtype="float32", kv_config=config) as llm:
        for line in sys.stdin:
            for _ in range(int(line)):
                llm.reset_prefix_cache()
                out = llm.generate([{"prompt_token_ids": SERVE_PROMPTS[i % 3]}], greedy)[0]
                print(json.dumps({"i": i, "tokens": list(out.outputs[0].token_ids),
                                  "external": out.num_external_tokens}), flush=True)
                i += 1


def churn(sock: str) -> None:
    from kvlayer import KVCacheEngine, KVLayout

    big = KVLayout(dtype=torch.float32, **BIG)
    shape = (2, 64, BIG["block_size"], BIG["num_kv_heads"], BIG["head_dim"])
    src = [torch.randn(shape) for _ in range(BIG["num_layers"])]
    dst = [torch.zeros(shape) for _ in range(BIG["num_layers"])]
    at = torch.arange(len(BIG_TOKENS))
    with KVCacheEngine({**kv_config(sock), "chunk_size": 64}, big, model_name="big", model_fingerprint="f") as kv:
        keys = kv.keys(BIG_TOKENS)
        while True:
            kv.remove(keys)
            kv.store(BIG_TOKENS, src, at)
            kv.retrieve(BIG_TOKENS, dst, at.flip(0))
            print("looped", flush=True)


def soak(sock: str, seed: str, n: str) -> dict:
    import random

    rng = random.Random(int(seed))
    dst, at = kv_caches(None), slots(len(TOKENS), 20)
    hit_tokens = bad_hits = 0
    with _engine(sock, "") as kv:
        for _ in range(int(n)):
            s = rng.randrange(SOAK_SEQS)
            tokens, src = [s * 1000 + t for t in TOKENS], kv_caches(1000 + s)
            for c in dst:
                c.zero_()
            got = kv.retrieve(tokens, dst, at)
            hit_tokens += got
            bad_hits += rows(dst, at[:got]) != rows(src, slots(got, 0))
            kv.store(tokens, src, slots(len(tokens), 0))
    return {"requests": int(n), "hit_tokens": hit_tokens, "bad_hits": bad_hits}


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "hold":
        hold(args[0], int(args[1]))
    elif mode in ("serve", "churn"):
        {"serve": serve, "churn": churn}[mode](*args)
    else:
        result = {"store": store, "retrieve": retrieve, "generate": generate, "soak": soak}[mode](*args)
        print(json.dumps(result), flush=True)
