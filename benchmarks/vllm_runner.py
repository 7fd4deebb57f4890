"""One vLLM engine measuring TTFT for ``kvlayer bench vllm``, in its own process.

    python -m kvlayer.benchmarks.vllm_runner SPEC.json

SPEC: ``model``, ``connector`` (null, ``"kvlayer"``, ``"offloading"`` or ``"lmcache"``),
``extra`` (the connector's ``kv_connector_extra_config``), ``prefix_caching``, ``block_size``,
``max_model_len``, ``lengths``, ``suffix``, ``repeat``, ``vocab``, ``dtype`` (default float32).
Per length n, with a prefix of n tokens of its own: ``miss``, the first prompt (prefix + a fresh
suffix; for a cache, the all-miss that stores it), then ``repeat`` prompts of the same prefix and
other fresh suffixes (``hit``: the prefix comes from the cache being measured, or is recomputed
without one). A prompt's TTFT is one ``generate`` of 1 token (its greedy token is kept: every
configuration sees the same prompts, so their tokens must agree). Each finished length is
printed as one JSON line ``{"length": n, ...}`` (the caller's progress bar advances on it); a start-up that fails prints
``{"error": ...}``. vLLM is imported here only, never by kvlayer's own processes.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CONNECTORS = {
    "kvlayer": ("KVLayerConnectorV1", "kvlayer.connectors.vllm_v1"),
    "offloading": ("OffloadingConnector", None),
    "lmcache": ("LMCacheConnectorV1", None),
}


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("connector"):
        name, module = CONNECTORS[spec["connector"]]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
            kv_connector_extra_config=spec.get("extra") or {})
    tp = spec.get("tensor_parallel_size", 1)
    if tp > 1:  # worker processes of their own; FlushWorkers lets this process reach their kvlayer
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp",
                      worker_extension_cls="kvlayer.benchmarks.vllm_runner.FlushWorkers")
    return LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"), enforce_eager=True,
               max_model_len=spec["max_model_len"], block_size=spec.get("block_size", 128),
               enable_prefix_caching=spec.get("prefix_caching", False), seed=0, **kwargs)


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to generate one token after ``prompt``, how many of its tokens vLLM counted
    cached, and the (greedy) token."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return time.perf_counter() - start, int(out.num_cached_tokens or 0), int(out.outputs[0].token_ids[0])


def in_process_worker() -> Any:
    """kvlayer's ``WorkerSide`` of the vLLM engine in this process (in-process vLLM mode), or None."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return getattr(get_kv_transfer_group(), "_worker", None) if has_kv_transfer_group() else None
    except Exception:
        return None


class FlushWorkers:
    """A vLLM worker extension (``worker_extension_cls``): ``kvlayer_flush`` waits for the
    worker's kvlayer writes, for ``collective_rpc`` from the engine's process."""

    def kvlayer_flush(self) -> bool:
        worker = in_process_worker()
        if worker is not None:
            worker.kv.flush()
        return worker is not None


def _flush(llm: Any, tp: int) -> None:
    """Wait for kvlayer's background writes (NVMe, Redis): in this process's worker, or with
    tensor parallelism in every rank's."""
    if tp > 1:
        llm.collective_rpc("kvlayer_flush")
        return
    worker = in_process_worker()
    if worker is not None:
        worker.kv.flush()


def run(spec: dict[str, Any]) -> None:
    started = time.perf_counter()
    try:
        llm = _engine(spec)
    except Exception as e:  # noqa: BLE001 - reported as this configuration's result
        print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}), flush=True)
        return
    print(json.dumps({"startup_s": time.perf_counter() - started}), flush=True)
    vocab = spec["vocab"]
    _ttft(llm, [5] * 16)  # warm-up
    for n in spec["lengths"]:
        rng = random.Random(n)
        prefix = [rng.randrange(3, vocab) for _ in range(n)]
        suffixes = [[rng.randrange(3, vocab) for _ in range(spec["suffix"])] for _ in range(spec["repeat"] + 1)]
        miss_s, _, first = _ttft(llm, prefix + suffixes[0])
        _flush(llm, spec.get("tensor_parallel_size", 1))  # the hits read what the miss stored
        hits = [_ttft(llm, prefix + s) for s in suffixes[1:]]
        print(json.dumps({"length": n, "miss_s": miss_s, "hit_s": statistics.median(h for h, _, _ in hits),
                          "hit_runs_s": [h for h, _, _ in hits], "cached": hits[-1][1],
                          "tokens": [first, *(t for _, _, t in hits)]}), flush=True)


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
    sys.stdout.flush()
    os._exit(0)  # vLLM's own shutdown takes seconds and leaves nothing to flush here
