"""Runs one vLLM engine (CPU build) for the vLLM connector's tests, in its own process.

    python -m tests.connectors.vllm_driver SPEC.json

SPEC: ``model`` (folder), ``kvlayer`` (kvlayer's ``kv_connector_extra_config``, or null for
vLLM alone), ``prefix_caching`` (bool), ``block_size``, ``blocks`` (vLLM's block count override,
or null), ``rounds``: a list of ``{"prompts": [[ids...]], "salts": [null | str, ...],
"max_tokens": n, "wait_for": path | null}``. A round with ``wait_for`` first writes
``<path>.ready`` and waits until ``path`` exists (a test does something in between). The last
line printed is JSON: per round the generated tokens and vLLM's ``num_cached_tokens`` of each
prompt, and the worker's kvlayer stats after each round (where the worker is in this process),
or ``{"error": ...}`` when the engine does not start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.vllm_runner import in_process_worker


def _stats() -> dict[str, Any] | None:
    """The worker's kvlayer stats once its background writes are done (None if out of reach)."""
    worker = in_process_worker()
    if worker is None:
        return None
    worker.kv.flush()
    return {**worker.kv.stats(), "connector": dict(worker.totals)}


def _wait(path: str) -> None:
    Path(path + ".ready").touch()
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody created {path}")
        time.sleep(0.05)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if spec.get("kvlayer") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVLayerConnectorV1", kv_connector_module_path="kvlayer.connectors.vllm_v1",
            kv_role="kv_both", kv_connector_extra_config=spec["kvlayer"])
    if spec.get("blocks"):
        kwargs["num_gpu_blocks_override"] = spec["blocks"]
    started = time.monotonic()
    try:
        llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=spec.get("max_model_len", 2048), block_size=spec.get("block_size", 32),
                  enable_prefix_caching=spec.get("prefix_caching", False), seed=0,
                  max_num_seqs=spec.get("max_num_seqs", 64), disable_log_stats=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test reads what stopped the start-up
        return {"error": f"{type(e).__name__}: {e}"}
    out: dict[str, Any] = {"startup_s": time.monotonic() - started, "rounds": []}
    for rnd in spec["rounds"]:
        if rnd.get("wait_for"):
            _wait(rnd["wait_for"])
        salts = rnd.get("salts") or [None] * len(rnd["prompts"])
        prompts = [{"prompt_token_ids": p, **({"cache_salt": s} if s else {})} for p, s in zip(rnd["prompts"], salts)]
        params = SamplingParams(max_tokens=rnd.get("max_tokens", 8), temperature=0, detokenize=False)
        results = llm.generate(prompts, params, use_tqdm=False)
        out["rounds"].append({"tokens": [list(r.outputs[0].token_ids) for r in results],
                              "cached": [r.num_cached_tokens for r in results], "stats": _stats()})
    out["preemptions"] = _preemptions(llm)
    return out


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
