"""One engine process of ``kvlayer bench cache-server-mrqa`` (``kvlayer.benchmarks.cache_server_mrqa``).

``python -m kvlayer.benchmarks.cache_server_mrqa_worker JOB.json OUT.json`` reads a ``Job``,
builds the bundled engine (``LLM``, one torch thread) with the job's kvlayer configuration (the
cache server's socket, or a private CPU tier), and serves the multi-round-QA users that are its
share (user ``i`` on engine ``i % engines``) on a simulated clock (benchmarks/driver.py): the
warm-up turns, then the measured ones. Before each phase it waits at a barrier (a file per
engine in ``Job.barrier``) until every engine is there, so both engines serve the same phase at
once. It writes one JSON object: per measured request its row (``serving.request_rows``), the
``sample`` measured requests with the most kvlayer tokens with their prompts and generated
tokens (for the exactness check), the tokens each kvlayer tier served while measuring, and the
kvlayer tiers' usage at the end (``used_bytes`` per tier, read before the engine closes).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.configs import BenchConfig, make_llm, tier_hit_tokens
from kvlayer.benchmarks.driver import RequestRecord, SimClock, drive
from kvlayer.benchmarks.serving import WARMUP_TOKENS, request_rows
from kvlayer.benchmarks.workloads import ChatSessions, MultiRoundSpec, Turn

BARRIER_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Job:
    """What one engine process serves: ``model`` with kvlayer ``kv`` (None: no kvlayer), an
    engine KV cache of ``num_gpu_blocks`` blocks (prefix cache ``prefix_caching``), engine
    ``index`` of ``engines``, the workload ``spec`` (a ``MultiRoundSpec``'s fields) at ``rate``
    with ``warmup_rounds``; ``sample`` requests kept for the exactness check; ``barrier``: the
    folder of the phase barriers."""

    model: str
    kv: dict[str, Any] | None
    num_gpu_blocks: int
    prefix_caching: bool
    index: int
    engines: int
    spec: dict[str, int]
    rate: float
    warmup_rounds: int
    sample: int
    barrier: str

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.engines:
            raise ValueError(f"engine index {self.index} outside [0, {self.engines})")

    def turns(self) -> tuple[list[Turn], list[Turn]]:
        """(warm-up, measured) turns of this engine's users."""
        warm, turns = MultiRoundSpec(**self.spec).turns(self.rate, self.warmup_rounds)
        return ([t for t in warm if t.user % self.engines == self.index],
                [t for t in turns if t.user % self.engines == self.index])


class _Recorded(ChatSessions):
    """``ChatSessions`` that also keep every answered turn's prompt and output."""

    def __init__(self, spec: MultiRoundSpec, vocab: int) -> None:
        super().__init__(spec, vocab)
        self.answers: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def answered(self, turn: Turn, prompt: list[int], output: list[int]) -> None:
        self.answers[turn.user, turn.index] = (prompt, list(output))
        super().answered(turn, prompt, output)


def barrier(folder: str, phase: str, index: int, engines: int, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Mark engine ``index`` as at ``phase`` and wait until all ``engines`` are (RuntimeError past
    ``timeout_s``: another engine died)."""
    Path(folder, f"{phase}.{index}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(Path(folder).glob(f"{phase}.*"))) < engines:
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine {index}: the other engines did not reach {phase!r} in {timeout_s:.0f} s")
        time.sleep(0.01)


def run(job: Job) -> dict[str, Any]:
    """Serve the job (see the module docstring); the JSON-ready result."""
    import torch

    from kvlayer.engine import SamplingParams

    torch.set_num_threads(1)
    spec = MultiRoundSpec(**job.spec)
    config = BenchConfig("worker", "worker", job.prefix_caching, job.kv)
    llm = make_llm(job.model, "cpu", config, num_gpu_blocks=job.num_gpu_blocks)
    try:
        vocab = llm.engine.model_config.vocab_size
        # shorter than a chunk, so kvlayer stores none of it: the bytes held are the workload's
        n = min(WARMUP_TOKENS, int((job.kv or {}).get("chunk_size", WARMUP_TOKENS + 1)) - 1)
        warm_prompt = [random.Random(-1).randrange(3, vocab) for _ in range(max(1, n))]
        llm.generate([{"prompt_token_ids": warm_prompt}], SamplingParams(max_tokens=2, temperature=0))
        params = SamplingParams(max_tokens=spec.answer_tokens, temperature=0, ignore_eos=True)
        sessions = _Recorded(spec, vocab)
        warmup, turns = job.turns()
        barrier(job.barrier, "warmup", job.index, job.engines)
        drive(llm.engine, warmup, sessions, params, SimClock())
        barrier(job.barrier, "measure", job.index, job.engines)
        before = tier_hit_tokens(llm.kv_stats())
        records = drive(llm.engine, turns, sessions, params, SimClock())
        stats = llm.kv_stats()
        after = tier_hit_tokens(stats)
    finally:
        llm.close()
    return {"index": job.index, "users": sorted({t.user for t in turns}), "requests": request_rows(records),
            "samples": _samples(records, sessions, job.sample),
            "tier_hit_tokens": {t: after[t] - before.get(t, 0) for t in after},
            "tiers": {name: {k: int(t.get(k, 0)) for k in ("used_bytes", "capacity_bytes")}
                      for name, t in stats.get("tiers", {}).items()}}


def _samples(records: list[RequestRecord], sessions: _Recorded, n: int) -> list[dict[str, Any]]:
    """The ``n`` measured requests with the most kvlayer tokens: user, turn, kvlayer tokens,
    prompt and generated tokens."""
    top = sorted(records, key=lambda r: (-r.num_external, r.turn.user, r.turn.index))[:n]
    out = []
    for r in top:
        prompt, output = sessions.answers[r.turn.user, r.turn.index]
        out.append({"user": r.turn.user, "turn": r.turn.index, "external": r.num_external, "prompt": prompt,
                    "output": output})
    return out


def job_json(job: Job) -> str:
    """``job`` as the JSON the worker reads."""
    return json.dumps(asdict(job))


if __name__ == "__main__":
    job_path, out_path = sys.argv[1:3]
    result = run(Job(**json.loads(Path(job_path).read_text(encoding="utf-8"))))
    Path(out_path).write_text(json.dumps(result), encoding="utf-8")
