"""Client processes of the cache-server tests: ``python -m tests.cacheserver.worker MODE ARGS...``.

- ``store SOCK SALT`` / ``retrieve SOCK SALT OUT``: a ``KVCacheEngine`` that is a client of the
  server stores ``kv_caches(SEED)`` for ``TOKENS``, or retrieves them into zeroed caches and writes
  the retrieved rows' bytes to OUT; prints one JSON line (``tokens``).
- ``generate SOCK MODEL``: the bundled engine (float32) with ``kv_config={"cache_server": SOCK}``
  answers ``PROMPT`` greedily; prints ``{"tokens": [...], "external": N}``.
- ``hold SOCK N``: a raw protocol client stores N chunks, leases them, reserves N more without
  committing, prints ``holding`` and sleeps (to be killed).
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
    from kvlayer.cacheserver import protocol as wire
    from kvlayer.cacheserver.sync_client import SyncClient

    client = SyncClient(sock)
    keys = [wire.Key(bytes([i]) * 32, b"t" * 16) for i in range(2 * n)]
    client.reserve([(k, 4000) for k in keys[:n]])
    client.commit([(k.digest, 0) for k in keys[:n]])
    client.lease(keys[:n])
    client.reserve([(k, 4000) for k in keys[n:]])  # reserved, never committed: a store cut off
    print("holding", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "hold":
        hold(args[0], int(args[1]))
    else:
        result = {"store": store, "retrieve": retrieve, "generate": generate}[mode](*args)
        print(json.dumps(result), flush=True)
