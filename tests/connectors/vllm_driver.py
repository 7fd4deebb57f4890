"""Runs one vLLM engine (CPU build) for the vLLM connector's tests, in its own process.

    python -m tests.connectors.vllm_driver SPEC.json

SPEC: ``model`` (folder), ``kvlayer`` (kvlayer's ``kv_connector_extra_config``, or null for
vLLM alone), ``prefix_caching`` (bool), ``block_size``, ``blocks`` (vLLM's block count override,
or null), ``kv_events`` (vLLM's KV-cache events: true for vLLM's "null" publisher, or a ZMQ
endpoint for vLLM's ZMQ publisher, which the driver subscribes to), ``rounds``: a list of
``{"prompts": [[ids...]], "salts": [null | str, ...], "max_tokens": n, "wait_for": path | null}``.
A round with ``wait_for`` first writes ``<path>.ready`` and waits until ``path`` exists (a test
does something in between); one with ``"reset": true`` first calls
``LLM.reset_prefix_cache(reset_connector=True)`` (its answers: the result's ``resets``). The
last line printed is JSON: per round the generated tokens and vLLM's ``num_cached_tokens`` of
each prompt, and the worker's kvlayer stats after each round (where the worker is in this
process), or ``{"error": ...}`` when the engine does not start. With ``kv_events``, each round
also has the KV-cache events vLLM's scheduler published during it (``_Published`` where the
scheduler is in this process, ``_Subscribed`` to the ZMQ endpoint otherwise): kvlayer's
(``events``) and how many were vLLM's own (``kvlayer.tier_events``); and, where the worker is in
this process, kvlayer's chunk keys of each prompt (``keys``, hex) and the digests each tier
holds after the round (``held``, hex).
``hybrid_manager`` (bool) turns vLLM's hybrid KV cache manager on or off (unset: vLLM decides);
the answer's ``kv_cache_groups`` lists vLLM's KV-cache groups where the scheduler is in this process.
``tensor_parallel_size`` > 1 runs that many worker processes (vLLM's "mp" executor); each round
then has ``ranks``: per rank (in rank order) its stats, keys and held digests as above, asked of
each worker through vLLM's ``collective_rpc`` and the ``WorkerReport`` extension (plain data).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.vllm_runner import in_process_worker


class _Published:
    """Stands in for the scheduler's event publisher (vLLM's "null" one, still called): keeps
    each batch as a subscriber would decode it (msgpack, as vLLM's ZMQ publisher sends it)."""

    def __init__(self, inner: Any) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self.inner, self.events = inner, []
        self._encode, self._decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(KVEventBatch).decode

    def publish(self, batch: Any) -> None:
        self.events.extend(self._decode(self._encode(batch)).events)
        self.inner.publish(batch)

    def take(self) -> tuple[list[dict[str, Any]], int]:
        events, self.events = self.events, []
        return _split(events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Subscribed:
    """A subscriber of vLLM's ZMQ publisher at ``endpoint`` (vLLM's scheduler in another process)."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        time.sleep(0.5)  # the subscription reaches the publisher before the first batch

    def take(self) -> tuple[list[dict[str, Any]], int]:
        events: list[Any] = []
        while self._socket.poll(1000):  # until a second passes with nothing new
            _topic, _seq, payload = self._socket.recv_multipart()
            events.extend(self._decode(payload).events)
        return _split(events)


def _split(events: list[Any]) -> tuple[list[dict[str, Any]], int]:
    """kvlayer's events, as JSON, and how many others (vLLM's own) came."""
    ours = [e for e in events if str(getattr(e, "medium", "")).startswith("kvlayer:")]
    return [_event(e) for e in ours], len(events) - len(ours)


def _event(e: Any) -> dict[str, Any]:
    def h(x: Any) -> Any:
        return x.hex() if isinstance(x, bytes) else x

    out = {"type": type(e).__name__, "medium": e.medium, "hashes": [h(x) for x in e.block_hashes]}
    if hasattr(e, "token_ids"):
        out.update(parent=h(e.parent_block_hash), tokens=list(e.token_ids), block_size=e.block_size)
    return out


def _published(llm: Any, kv_events: bool | str) -> _Published | _Subscribed | None:
    """Wrap the publisher of vLLM's scheduler where it is in this process (in-process mode), or
    subscribe to ``kv_events``, vLLM's ZMQ endpoint."""
    if isinstance(kv_events, str):
        return _Subscribed(kv_events)
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return None
    scheduler.kv_event_publisher = _Published(scheduler.kv_event_publisher)
    return scheduler.kv_event_publisher


def _keys(prompts: list[list[int]], salts: list[str | None]) -> dict[str, Any]:
    """kvlayer's chunk keys of each prompt and what each tier holds (after its background writes)."""
    worker = in_process_worker()
    if worker is None:
        return {}
    worker.kv.flush()
    held = {tier: sorted(d.hex() for d in digests) for tier, digests in worker.kv.snapshot().items()}
    return {"keys": [[k.hex for k in worker.kv.keys(p, s)] for p, s in zip(prompts, salts)], "held": held}


def _stats() -> dict[str, Any] | None:
    """The worker's kvlayer stats once its background writes are done (None if out of reach)."""
    worker = in_process_worker()
    if worker is None:
        return None
    worker.kv.flush()
    return {**worker.kv.stats(), "connector": dict(worker.totals)}


class WorkerReport:
    """A vLLM worker extension (``worker_extension_cls``): what kvlayer's worker side in this
    worker process holds, for the driver's ``collective_rpc("kvlayer_report", ...)``."""

    def kvlayer_report(self, prompts: list[list[int]], salts: list[str | None]) -> dict[str, Any] | None:
        worker = in_process_worker()
        if worker is None:
            return None
        worker.kv.flush()
        held = {tier: sorted(d.hex() for d in digests) for tier, digests in worker.kv.snapshot().items()}
        return {"rank": worker.kv.namespace.tp_rank, "stats": {**worker.kv.stats(), "connector": dict(worker.totals)},
                "keys": [[k.hex for k in worker.kv.keys(p, s)] for p, s in zip(prompts, salts)], "held": held}


def _wait(path: str) -> None:
    Path(path + ".ready").touch()
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody created {path}")
        time.sleep(0.05)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("kvlayer") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVLayerConnectorV1", kv_connector_module_path="kvlayer.connectors.vllm_v1",
            kv_role="kv_both", kv_connector_extra_config=spec["kvlayer"])
    if isinstance(spec.get("kv_events"), str):
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"])
    elif spec.get("kv_events"):
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if spec.get("blocks"):
        kwargs["num_gpu_blocks_override"] = spec["blocks"]
    if spec.get("hybrid_manager") is not None:  # None: vLLM decides (off with a connector lacking SupportsHMA)
        kwargs["disable_hybrid_kv_cache_manager"] = not spec["hybrid_manager"]
    tp = spec.get("tensor_parallel_size", 1)
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp",
                      worker_extension_cls="tests.connectors.vllm_driver.WorkerReport")
    started = time.monotonic()
    try:
        llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=spec.get("max_model_len", 2048), block_size=spec.get("block_size", 32),
                  enable_prefix_caching=spec.get("prefix_caching", False), seed=0,
                  max_num_seqs=spec.get("max_num_seqs", 64), disable_log_stats=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads what stopped the start-up
        return {"error": f"{type(e).__name__}: {e}"}
    out: dict[str, Any] = {"startup_s": time.monotonic() - started, "rounds": [], "kv_cache_groups": _groups(llm)}
    published = _published(llm, spec["kv_events"]) if spec.get("kv_events") else None
    for rnd in spec["rounds"]:
        if rnd.get("wait_for"):
            _wait(rnd["wait_for"])
        if rnd.get("reset"):  # as after a weight update: vLLM's prefix cache and the connector's
            out.setdefault("resets", []).append(llm.reset_prefix_cache(reset_connector=True))
        salts = rnd.get("salts") or [None] * len(rnd["prompts"])
        prompts = [{"prompt_token_ids": p, **({"cache_salt": s} if s else {})} for p, s in zip(rnd["prompts"], salts)]
        params = SamplingParams(max_tokens=rnd.get("max_tokens", 8), temperature=0, detokenize=False)
        results = llm.generate(prompts, params, use_tqdm=False)
        out["rounds"].append({"tokens": [list(r.outputs[0].token_ids) for r in results],
                              "cached": [r.num_cached_tokens for r in results], "stats": _stats()})
        if tp > 1 and spec.get("kvlayer") is not None:
            out["rounds"][-1]["ranks"] = llm.collective_rpc("kvlayer_report", args=(rnd["prompts"], salts))
        if published is not None:
            events, others = published.take()
            out["rounds"][-1].update(events=events, vllm_events=others, **_keys(rnd["prompts"], salts))
    out["preemptions"] = _preemptions(llm)
    return out


def _groups(llm: Any) -> list[dict[str, Any]] | None:
    """vLLM's KV-cache groups (spec class, sliding window, layer names) where its scheduler is in
    this process: more than one means vLLM's hybrid KV cache manager is on for a hybrid model."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    if config is None:
        return None
    return [{"spec": type(g.kv_cache_spec).__name__, "window": getattr(g.kv_cache_spec, "sliding_window", None),
             "layers": list(g.layer_names)} for g in config.kv_cache_groups]


def _preemptions(llm: Any) -> int:
    """vLLM's own count of preempted requests."""
    try:
        return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if "preempt" in m.name))
    except Exception:
        return -1


if __name__ == "__main__":
    result = run(json.loads(Path(sys.argv[1]).read_text()))
    print(json.dumps(result), flush=True)
    os._exit(0)  # vLLM's shutdown can take seconds; nothing is left to flush
