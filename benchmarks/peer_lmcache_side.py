"""The LMCache side of ``kvlayer bench peer``: runs in the peer venv (LMCache 0.5.6), never in kvlayer's.

Started by ``kvlayer.benchmarks.peer_lmcache`` as ``python peer_lmcache_side.py SPEC.json``. The
spec names the paged KV (float32 raw bytes in a file: the source caches, then the slots as
int64) and its shape; the script maps the file, builds one LMCache ``LMCacheEngine`` per tier
when told, and answers one JSON line per command line on stdin:

- ``{"cmd": "open", "tier": "cpu"|"nvme"|"redis", ...}``: an engine with only that tier
  (``local_cpu``; ``local_disk`` with ``local_cpu`` off; ``remote_url`` redis with it off);
- ``{"cmd": "store", "round": N}``: ``store`` the KV under tokens of round N's own (the first
  token changed, so every chunk key is new: LMCache's disk and remote tiers cannot be cleared)
  and wait until LMCache's lookup sees every token (the write reached the tier: a durable
  store); answers ``seconds``. Round 0 stores the tokens ``retrieve`` reads;
- ``{"cmd": "retrieve"}``: zero the destination (untimed), ``retrieve``; answers ``seconds``;
- ``{"cmd": "check"}``: whether the destination equals the source at every slot;
- ``{"cmd": "version"}``, ``{"cmd": "close"}`` and ``{"cmd": "quit"}``.

The paged caches are vLLM's flash-attention layout, ``[2, blocks, block_size, heads, dim]`` per
layer; LMCache has no vLLM connector for a CPU device, so ``CpuPagedConnector`` moves chunks
with LMCache's own CPU kernel (``device_ops.multi_layer_kv_transfer``, its torch fallback).
This file imports only LMCache, torch and the standard library.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
import time
from typing import Any

import lmcache.lmcache_native as native
import torch
from lmcache import device_ops
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

# vLLM's flash-attention paged layout: a list of per-layer [2, blocks, block_size, heads, dim]
FORMAT = native.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
CLOSE_S = 10.0


class CpuPagedConnector(GPUConnectorInterface):
    """Chunks of ``KV_2LTD`` memory objects to and from paged CPU caches at ``slot_mapping``."""

    def __init__(self, layers: int, heads: int, dim: int, pages: int) -> None:
        self.layers, self.hidden, self.pages = layers, heads * dim, pages
        self.kvcaches: list[torch.Tensor] | None = None

    def _flats(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        return [c.view(2, self.pages, self.hidden) for c in kwargs["kvcaches"]]

    def _move(self, obj: MemoryObj, start: int, end: int, kwargs: dict[str, Any], direction: Any) -> None:
        assert obj.tensor is not None
        device_ops.multi_layer_kv_transfer(obj.tensor, self._flats(kwargs), kwargs["slot_mapping"][start:end],
                                           torch.device("cpu"), self.pages, direction, FORMAT)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self._move(memory_obj, start, end, kwargs, native.TransferDirection.H2D)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        self._move(memory_obj, start, end, kwargs, native.TransferDirection.D2H)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(obj, s, e, **kwargs)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(obj, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])


class Side:
    """The mapped KV and the LMCache engine of the tier now open."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        layers, blocks, bs, heads, dim = (spec[k] for k in ("layers", "blocks", "block_size", "heads", "dim"))
        self.shape = (2, blocks, bs, heads, dim)
        per_layer = 2 * blocks * bs * heads * dim
        with open(spec["kv_file"], "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        flat = torch.frombuffer(self._map, dtype=torch.float32, count=layers * per_layer)
        self.src = [flat[i * per_layer:(i + 1) * per_layer].view(self.shape) for i in range(layers)]
        self.slots = torch.frombuffer(self._map, dtype=torch.int64, count=spec["tokens"],
                                      offset=layers * per_layer * 4).clone()
        self.dst = [torch.zeros(self.shape) for _ in range(layers)]
        self.tokens = torch.tensor(spec["token_ids"], dtype=torch.long)
        self.engine: LMCacheEngine | None = None
        self.name = ""

    def open(self, tier: str, disk: str, url: str) -> dict[str, Any]:
        s = self.spec
        gib = s["capacity_bytes"] / 2**30
        settings: dict[str, Any] = {"chunk_size": s["chunk_tokens"], "local_cpu": tier == "cpu",
                                    "max_local_cpu_size": max(gib, 0.25), "save_unfull_chunk": False}
        if tier == "nvme":
            settings.update(local_disk=f"file://{disk}/", max_local_disk_size=max(gib, 0.25))
        elif tier == "redis":
            settings.update(remote_url=url, remote_serde="naive")
        config = LMCacheEngineConfig.from_dict(settings)
        meta = LMCacheMetadata(model_name="bench-peer", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float32,
                               kv_shape=(s["layers"], 2, s["chunk_tokens"], s["heads"], s["dim"]))
        connector = CpuPagedConnector(s["layers"], s["heads"], s["dim"], self.shape[1] * self.shape[2])
        self.name = f"bench-peer-{tier}"
        self.engine = LMCacheEngineBuilder.get_or_create(self.name, config, meta, connector,
                                                         lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        return {"ok": True}

    def store(self, round_: int) -> dict[str, Any]:
        assert self.engine is not None
        tokens = self.tokens.clone()
        if round_:  # the spec's token ids are below 30,000: a first token of its own, a fresh chain of keys
            tokens[0] = 30_000 + round_
        if self.engine.lookup(tokens) != 0:
            raise RuntimeError(f"LMCache already holds round {round_}'s tokens")
        start = time.perf_counter()
        self.engine.store(tokens, kvcaches=self.src, slot_mapping=self.slots)
        while self.engine.lookup(tokens) < len(tokens):  # until the tier has every chunk
            time.sleep(0.0002)
        return {"seconds": time.perf_counter() - start}

    def retrieve(self) -> dict[str, Any]:
        assert self.engine is not None
        for d in self.dst:
            d.zero_()
        start = time.perf_counter()
        got = self.engine.retrieve(self.tokens, kvcaches=self.dst, slot_mapping=self.slots)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": int(got.sum())}

    def check(self) -> dict[str, Any]:
        flat = (2, -1, self.shape[3], self.shape[4])
        same = all(torch.equal(d.view(flat)[:, self.slots], s.view(flat)[:, self.slots])
                   for d, s in zip(self.dst, self.src))
        return {"exact": same}

    def close(self) -> dict[str, Any]:
        """Destroy the engine; LMCache 0.5.6's redis backend can hang in its close, so at most
        ``CLOSE_S`` seconds are waited (the engine is then left behind, under its own name)."""
        if self.engine is None:
            return {"ok": True}
        closer = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(self.name,), daemon=True)
        closer.start()
        closer.join(CLOSE_S)
        self.engine = None
        return {"ok": True, "closed": not closer.is_alive()}


def main(spec_path: str) -> int:
    """Answer commands until ``quit`` or end of input; an error is answered as ``{"error": ...}``."""
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    side = Side(spec)
    out = sys.stdout
    sys.stdout = sys.stderr  # LMCache's own prints must not mix with the answers
    print(json.dumps({"ready": True, "lmcache": _version()}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "open":
                answer = side.open(cmd["tier"], cmd.get("disk", ""), cmd.get("url", ""))
            elif cmd["cmd"] == "store":
                answer = side.store(int(cmd["round"]))
            else:
                answer = {"retrieve": side.retrieve, "check": side.check, "close": side.close,
                          "version": lambda: {"lmcache": _version()}}[cmd["cmd"]]()
        except Exception as e:  # the driver prints it and stops
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), file=out, flush=True)
    side.close()
    sys.stderr.flush()
    os._exit(0)  # LMCache's non-daemon threads would keep the process alive


def _version() -> str:
    from importlib.metadata import version

    return version("lmcache")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
