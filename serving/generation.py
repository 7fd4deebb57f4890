"""One generation request of the HTTP API: its choices submitted to the engine, then their events.

A request has one or more prompts and ``n`` choices per prompt; choice ``i * n + j`` is the
``j``-th sample of prompt ``i`` (OpenAI's numbering), run as its own engine request (with
``seed + j`` when a seed is given, so choices differ yet each is reproducible).
``Generation.events()`` merges the choices' progress into ``Event``s (new text, new token ids,
a finish reason) in the order the engine produced them; leaving it early aborts every
unfinished choice. A choice the engine failed (finish reason "error": this request alone, or
every request of a step that raised) raises ``EngineError`` from ``events()``; its unfinished
sibling choices are then stopped and counted as "error" too ("abort" is only for a consumer
that left). Usage follows OpenAI: prompt tokens once per prompt, completion tokens
over all choices; ``cached_tokens`` is, per prompt, the most prompt tokens any of its choices
took from a cache (the engine's own prefix cache plus kvlayer's tiers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlayer.engine.sampling import SamplingParams
from kvlayer.engine.tokenizer import Tokenizer
from kvlayer.serving.engine_loop import AsyncEngine, EngineError, RequestHandle
from kvlayer.serving.metrics import ServingMetrics
from kvlayer.serving.text import TextStream


@dataclass(slots=True)
class Choice:
    """One choice's progress; ``token_ids`` are all its generated ids (up to a stop string)."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    handle: RequestHandle
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached: int = 0
    last_token_time: float | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """Choice ``choice`` produced ``text`` and ``token_ids`` (either may be empty); a non-None
    ``finish_reason`` ("stop" or "length") is its last event (an "error" is raised instead)."""

    choice: Choice
    text: str
    token_ids: list[int]
    finish_reason: str | None


_DONE = object()


class Generation:
    """Submitted choices of one request (``start``), streamed by ``events()``."""

    def __init__(self, choices: list[Choice], prompts: list[list[int]], metrics: ServingMetrics,
                 arrival: float) -> None:
        self.choices = choices
        self.prompts = prompts
        self._metrics = metrics
        self._arrival = arrival
        self.created = int(time.time())

    @classmethod
    async def start(cls, engine: AsyncEngine, prompts: Sequence[list[int]], params: SamplingParams, n: int,
                    salt: str | None, tokenizer: Tokenizer | None, stop: Sequence[str], metrics: ServingMetrics,
                    id_prefix: str) -> Generation:
        """Submit ``n`` choices of each prompt (token ids); raises what ``AsyncEngine.submit``
        raises, after aborting the choices already submitted."""
        arrival = time.perf_counter()
        choices: list[Choice] = []
        try:
            for pi, ids in enumerate(prompts):
                for j in range(n):
                    p = params if params.seed is None or j == 0 else _with_seed(params, params.seed + j)
                    prompt: dict[str, Any] = {"prompt_token_ids": ids}
                    if salt is not None:
                        prompt["cache_salt"] = salt
                    handle = await engine.submit(prompt, p, engine.new_request_id(id_prefix))
                    choices.append(Choice(pi * n + j, pi, ids, handle, TextStream(tokenizer, stop)))
        except BaseException:
            for c in choices:
                c.handle.abort()
            raise
        return cls(choices, [list(p) for p in prompts], metrics, arrival)

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events until all have finished (see the module docstring)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, queue)) for c in self.choices]
        remaining = len(tasks)
        reason = "abort"
        try:
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, EngineError):
                        reason = "error"
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            self.abort(reason)

    def abort(self, reason: str = "abort") -> None:
        """Stop every unfinished choice, counted under finish reason ``reason`` in the metrics."""
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = reason
                self._metrics.requests.labels(reason).inc()
            c.handle.abort()

    async def _pump(self, choice: Choice, queue: asyncio.Queue[Any]) -> None:
        try:
            first = True
            async for out in choice.handle.outputs():
                comp = out.outputs[0]
                new = list(comp.token_ids[len(choice.token_ids):])
                if first:
                    choice.cached = out.num_cached_tokens + out.num_external_tokens
                    first = False
                self._timing(choice, bool(new))
                choice.token_ids.extend(new)
                piece = choice.text.add(new)
                reason = None
                if choice.text.stopped:
                    reason = "stop"
                    choice.handle.abort()
                elif out.finished and comp.finish_reason == "error":
                    self._finished(choice, "error")
                    raise EngineError(f"the engine failed on this request: {comp.error}")
                elif out.finished:
                    piece += choice.text.finish()
                    reason = comp.finish_reason
                if reason is not None:
                    self._finished(choice, reason)
                queue.put_nowait(Event(choice, piece, new, reason))
                if reason is not None:
                    break
        except BaseException as e:  # the consumer re-raises it (cancellation ends the task quietly)
            if isinstance(e, EngineError) and choice.finish_reason is None:
                self._finished(choice, "error")
            if not isinstance(e, asyncio.CancelledError):
                queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    def _timing(self, choice: Choice, has_tokens: bool) -> None:
        if not has_tokens:
            return
        now = time.perf_counter()
        if choice.last_token_time is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            self._metrics.itl.observe(now - choice.last_token_time)
        choice.last_token_time = now

    def _finished(self, choice: Choice, reason: str) -> None:
        choice.finish_reason = reason
        self._metrics.generation_tokens.inc(len(choice.token_ids))
        self._metrics.requests.labels(reason).inc()
        if all(c.finish_reason is not None for c in self.choices):
            usage = self.usage()
            self._metrics.prompt_tokens.inc(usage["prompt_tokens"])
            self._metrics.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object (see the module docstring)."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        cached: dict[int, int] = {}
        for c in self.choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
