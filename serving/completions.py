"""``/v1/completions`` and ``/v1/chat/completions``: a validated request in, OpenAI's answer out.

Both endpoints turn the request into prompts of token ids and sampling parameters, start a
``Generation`` and answer either one JSON body or server-sent events (``stream: true``): one
chunk per engine step and choice, an error chunk if the engine fails mid-stream, then
``data: [DONE]``; ``stream_options.include_usage`` adds ``usage: null`` to every chunk and a
last chunk with the usage and no choices. ``return_token_ids`` adds ``token_ids`` to each
choice (each chunk's new ids when streaming) and ``prompt_token_ids`` to a choice's first.
A client that disconnects aborts the request: Starlette cancels a streamed answer, and a
plain one is raced against the disconnect here. ``kv_transfer_params: {"do_remote_decode":
true}`` (a prefill for another instance's decode) answers once kvlayer has written the
prompt's KV everywhere, the shared tier included: ``kv_transfer_params.kv_written`` says
whether that happened within ``FLUSH_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvlayer.engine.sampling import SamplingParams
from kvlayer.engine.tokenizer import Tokenizer
from kvlayer.serving.chat import ChatTemplate
from kvlayer.serving.engine_loop import AsyncEngine, EngineError, Overloaded, ShuttingDown
from kvlayer.serving.generation import Event, Generation
from kvlayer.serving.metrics import ServingMetrics
from kvlayer.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, GenerationRequest, error_body

FLUSH_TIMEOUT_S = 30.0
"""How long a prefill for a remote decode waits for kvlayer's writes before answering anyway."""


@dataclass(frozen=True, slots=True)
class ServerState:
    """What the handlers share: the engine loop and the model's facts."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate
    metrics: ServingMetrics
    vocab_size: int
    max_model_len: int


async def completions(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    params = _sampling(state, req)
    prompts = [_token_ids(state, p) for p in req.prompts()]
    gen = await _start(state, req, prompts, params, "cmpl")
    return await _answer(req, gen, request, _CompletionShape(state.model_name, gen.created), state.engine)


async def chat_completions(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    params = _sampling(state, req)
    if state.tokenizer is None:
        raise APIError(400, "chat needs a tokenizer.json in the model folder; use /v1/completions with token ids",
                       "messages")
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
    try:
        text = state.chat_template.render(messages, req.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    ids = state.tokenizer.encode(text, add_special_tokens=state.chat_template.fallback)
    gen = await _start(state, req, [_check_ids(state, ids)], params, "chatcmpl")
    return await _answer(req, gen, request, _ChatShape(state.model_name, gen.created), state.engine)


# ----- request -> engine ---------------------------------------------------------------
def _sampling(state: ServerState, req: GenerationRequest) -> SamplingParams:
    if req.model != state.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                       "model")
    limit = req.token_limit()
    if limit is None:
        raise APIError(400, "max_tokens is required (this server does not guess an answer's length)", "max_tokens")
    if limit < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {limit}", "max_tokens")
    top_k = None if req.top_k in (None, 0, -1) else req.top_k
    if top_k is not None and top_k < 0:
        raise APIError(400, f"top_k must be -1, 0 (off) or positive, got {top_k}", "top_k")
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                       "stop_token_ids")
    try:
        return SamplingParams(max_tokens=limit, temperature=float(req.temperature), top_k=top_k,
                              top_p=float(req.top_p), seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _token_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise APIError(400, "a text prompt needs a tokenizer.json in the model folder; send token ids instead",
                           "prompt")
        prompt = state.tokenizer.encode(prompt)
    return _check_ids(state, prompt)


def _check_ids(state: ServerState, ids: list[int]) -> list[int]:
    if not ids:
        raise APIError(400, "the prompt is empty: a request needs at least one token", "prompt")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})", "prompt")
    if len(ids) >= state.max_model_len:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context holds {state.max_model_len} "
                       "(one more is needed to generate)", "prompt")
    return ids


async def _start(state: ServerState, req: GenerationRequest, prompts: list[list[int]], params: SamplingParams,
                 kind: str) -> Generation:
    try:
        stop = req.stop_strings
        return await Generation.start(state.engine, prompts, params, req.n, req.cache_salt, state.tokenizer,
                                      stop, state.metrics, f"{kind}-{uuid.uuid4().hex[:16]}")
    except (Overloaded, ShuttingDown) as e:
        raise APIError(503, str(e)) from None
    except EngineError as e:
        raise APIError(500, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None


# ----- engine -> answer ------------------------------------------------------------------
class _CompletionShape:
    """OpenAI's text-completion objects."""

    def __init__(self, model: str, created: int) -> None:
        self.head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
                     "model": model}

    def choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.head, "choices": choices}


class _ChatShape(_CompletionShape):
    """OpenAI's chat-completion objects (deltas when streaming, the role in a first chunk)."""

    def __init__(self, model: str, created: int) -> None:
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created,
                     "model": model}
        self._chunk_head = {**self.head, "object": "chat.completion.chunk"}

    def choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in gen.choices]

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        for c in choices:
            if "message" in c:
                c["delta"] = {"content": c.pop("message")["content"]}
        return {**self._chunk_head, "choices": choices}


async def _answer(req: GenerationRequest, gen: Generation, request: Request, shape: _CompletionShape,
                  engine: AsyncEngine) -> Response:
    if req.stream:
        return StreamingResponse(_sse(req, gen, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        body = await _unless_disconnected(_collect(req, gen, shape), request)
    except EngineError as e:
        raise APIError(500, str(e)) from None
    if body is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if req.remote_decode:
        body["kv_transfer_params"] = {"kv_written": await engine.flush_kv(FLUSH_TIMEOUT_S)}
    return JSONResponse(body)


async def _collect(req: GenerationRequest, gen: Generation, shape: _CompletionShape) -> dict[str, Any]:
    texts = {c.index: "" for c in gen.choices}
    async for ev in gen.events():
        texts[ev.choice.index] += ev.text
    choices = []
    for c in sorted(gen.choices, key=lambda c: c.index):
        item = shape.choice(c.index, texts[c.index], c.finish_reason)
        if req.return_token_ids:
            item.update(prompt_token_ids=c.prompt_ids, token_ids=c.token_ids)
        choices.append(item)
    return shape.body(choices, gen.usage())


async def _unless_disconnected(work: Any, request: Request) -> Any:
    """``await work``, or None once the client has disconnected (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(req: GenerationRequest, gen: Generation, shape: _CompletionShape) -> AsyncIterator[bytes]:
    usage_field = {"usage": None} if req.include_usage else {}
    sent_prompt: set[int] = set()

    def frame(obj: dict[str, Any]) -> bytes:
        return f"data: {json.dumps({**obj, **usage_field} if 'error' not in obj else obj)}\n\n".encode()

    opening = shape.opening(gen)
    if opening:
        yield frame(shape.chunk(opening))
    try:
        async for ev in gen.events():
            if not (ev.text or ev.token_ids or ev.finish_reason):
                continue
            yield frame(shape.chunk([_chunk_choice(req, shape, ev, sent_prompt)]))
    except (EngineError, ShuttingDown) as e:
        yield frame(error_body(500, str(e)))
        yield b"data: [DONE]\n\n"
        return
    if req.include_usage:
        yield f"data: {json.dumps({**shape.chunk([]), 'usage': gen.usage()})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _chunk_choice(req: GenerationRequest, shape: _CompletionShape, ev: Event, sent_prompt: set[int]) -> dict[str, Any]:
    item = shape.choice(ev.choice.index, ev.text, ev.finish_reason)
    if req.return_token_ids:
        if ev.choice.index not in sent_prompt:
            sent_prompt.add(ev.choice.index)
            item["prompt_token_ids"] = ev.choice.prompt_ids
        item["token_ids"] = ev.token_ids
    return item

