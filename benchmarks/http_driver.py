"""Concurrent chat users against an OpenAI-compatible server, on the wall clock.

``run_phase`` serves a list of ``Turn`` arrivals (benchmarks/workloads.py) through one
``httpx.AsyncClient``: one asyncio task per user, each sending its turns in order, so a user
has at most one request in flight; a turn is submitted at its arrival time, or when the
user's previous answer has come if that is later, and its TTFT counts from submission. The
generated token ids are the answer the workload appends to the user's history
(``Sessions.answered``). A server that sends no ``token_ids`` gets a stand-in answer of the
right length (``stand_in_answer``: the prompt's first tokens), counted in ``stand_in``; a
failed request leaves its user's history as it was.

``summarize_http`` turns records into plain data (latency percentiles, throughput, cached
share, failures); ``request_rows`` lists them per request for JSON and plots.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvlayer.benchmarks.driver import Sessions
from kvlayer.benchmarks.http_client import Completion, completion_body, stream_completion
from kvlayer.benchmarks.stats import summarize
from kvlayer.benchmarks.workloads import Turn


@dataclass(frozen=True, slots=True)
class HttpRecord:
    """One turn as sent: ``submit_s`` seconds after its phase started, ``num_prompt`` prompt
    tokens sent, what came back (``result``), and whether its answer in the user's history is
    a stand-in (the server sent no token ids)."""

    turn: Turn
    submit_s: float
    num_prompt: int
    result: Completion
    stand_in: bool = False


def stand_in_answer(prompt: list[int], n: int) -> list[int]:
    """``n`` tokens standing in for an answer the server did not send as ids: the prompt's
    first ``n`` tokens, repeated if the prompt is shorter (empty prompt: token 3)."""
    source = prompt or [3]
    return (source * (n // len(source) + 1))[:n]


async def run_phase(client: httpx.AsyncClient, model: str, turns: list[Turn], sessions: Sessions,
                    answer_tokens: int, advance: Callable[[int], None]) -> list[HttpRecord]:
    """Serve ``turns`` (each asking ``answer_tokens`` tokens of ``model``); returns the records in
    submission order. ``advance(1)`` is called as each request ends, failed or not."""
    queues: dict[int, list[Turn]] = {}
    for turn in sorted(turns, key=lambda t: (t.time, t.index)):
        queues.setdefault(turn.user, []).append(turn)
    start = time.perf_counter()

    async def user(queue: list[Turn]) -> list[HttpRecord]:
        out = []
        for turn in queue:
            delay = start + turn.time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = sessions.prompt(turn)
            submit = time.perf_counter() - start
            result = await stream_completion(client, completion_body(model, prompt, answer_tokens))
            stand_in = result.ok and not result.token_ids
            if result.ok:
                answer = list(result.token_ids) if result.token_ids else stand_in_answer(
                    prompt, result.completion_tokens or answer_tokens)
                sessions.answered(turn, prompt, answer)
            out.append(HttpRecord(turn, submit, len(prompt), result, stand_in))
            advance(1)
        return out

    per_user = await asyncio.gather(*(user(q) for q in queues.values()))
    return sorted((r for rs in per_user for r in rs), key=lambda r: (r.submit_s, r.turn.user))


def summarize_http(label: str, records: list[HttpRecord]) -> dict[str, Any]:
    """The plain-data result of one phase: counts, TTFT and inter-token-latency summaries
    (``stats.summarize``, over succeeded requests), requests/s and tokens/s over the span from
    the first submission to the last successful end, the cached share of prompt tokens (over
    requests whose usage reported cached tokens; None if none did), and the failures grouped
    by (status, message) in order of first appearance."""
    ok = [r for r in records if r.result.ok]
    failed = [r for r in records if not r.result.ok]
    span = (max(r.submit_s + r.result.end_s for r in ok) - min(r.submit_s for r in records)) if ok else 0.0
    completion = sum(_completion_tokens(r) for r in ok)
    prompt = sum(_prompt_tokens(r) for r in ok)
    with_cached = [r for r in ok if r.result.cached_tokens is not None]
    cached_prompt = sum(_prompt_tokens(r) for r in with_cached)
    groups = Counter((r.result.status, r.result.error) for r in failed)
    return {
        "label": label, "requests": len(records), "succeeded": len(ok), "failed": len(failed),
        "failures": [{"status": s, "error": e, "count": n} for (s, e), n in groups.items()],
        "span_s": span,
        "ttft_s": summarize([r.result.ttft for r in ok if r.result.ttft is not None]),
        "itl_s": summarize([g for r in ok for g in r.result.inter_token_latencies]),
        "request_per_s": len(ok) / span if span > 0 else None,
        "generated_tok_per_s": completion / span if span > 0 else None,
        "prompt_tok_per_s": prompt / span if span > 0 else None,
        "prompt_tokens": prompt, "completion_tokens": completion,
        "cached_tokens": sum(r.result.cached_tokens or 0 for r in with_cached) if with_cached else None,
        "cached_share": (sum(r.result.cached_tokens or 0 for r in with_cached) / cached_prompt
                         if cached_prompt else None),
        "cached_reported": len(with_cached), "stand_in_answers": sum(r.stand_in for r in records),
    }


def _prompt_tokens(r: HttpRecord) -> int:
    return r.result.prompt_tokens if r.result.prompt_tokens is not None else r.num_prompt


def _completion_tokens(r: HttpRecord) -> int:
    if r.result.completion_tokens is not None:
        return r.result.completion_tokens
    return len(r.result.token_ids) or len(r.result.token_times)


def request_rows(records: list[HttpRecord]) -> list[dict[str, Any]]:
    """Per request, in submission order: user, turn, submit time, TTFT, mean inter-token
    latency, end, the tokens sent and counted by the server, and status/error."""
    rows = []
    for r in records:
        c = r.result
        itl = c.inter_token_latencies
        rows.append({"user": r.turn.user, "turn": r.turn.index, "submit_s": r.submit_s, "ttft_s": c.ttft,
                     "itl_mean_s": sum(itl) / len(itl) if itl else None, "end_s": r.submit_s + c.end_s,
                     "prompt_sent": r.num_prompt, "prompt": c.prompt_tokens, "output": c.completion_tokens,
                     "output_ids": len(c.token_ids), "cached": c.cached_tokens, "stand_in": r.stand_in,
                     "status": c.status, "error": c.error})
    return rows
