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

from kvlayer.engine.sampling import SEED_MAX, InvalidSamplingParam, SamplingParams
from kvlayer.engine.tokenizer import Tokenizer
from kvlayer.serving.chat import ChatTemplate
from kvlayer.serving.engine_loop import AsyncEngine, EngineError, Overloaded, ShuttingDown
from kvlayer.serving.generation import Event, Generation
from kvlayer.serving.metrics import ServingMetrics
from kvlayer.serving.prompt_tokens import PromptTooLong, encode_prompt
from kvlayer.serving.protocol import (
    MAX_N,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    context_message,
    error_body,
    shown,
)

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
    _check_room(state, params.max_tokens)
    prompts = [await _token_ids(state, p, params.max_tokens) for p in req.prompts()]
    gen = await _start(state, req, prompts, params, "cmpl")
    return await _answer(req, gen, request, _CompletionShape(state.model_name, gen.created), state.engine)


async def chat_completions(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    params = _sampling(state, req)
    _check_room(state, params.max_tokens)
    if state.tokenizer is None:
        raise APIError(400, "chat needs a tokenizer.json in the model folder; use /v1/completions with token ids",
                       "messages")
    text = await asyncio.to_thread(_render, state, req)
    ids = await _encode(state, text, "messages", add_special_tokens=state.chat_template.fallback)
    gen = await _start(state, req, [_check_ids(state, ids, params.max_tokens, "messages")], params, "chatcmpl")
    return await _answer(req, gen, request, _ChatShape(state.model_name, gen.created), state.engine)


# ----- request -> engine ---------------------------------------------------------------
def _sampling(state: ServerState, req: GenerationRequest) -> SamplingParams:
    """The request's sampling values as the engine's ``SamplingParams``; ``APIError`` 404 for
    another model, 400 naming the field for a value out of range (NaN and infinity included)."""
    if req.model != state.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                       "model")
    limit = req.token_limit()
    if limit is None:
        raise APIError(400, "max_tokens is required (this server does not guess an answer's length)", "max_tokens")
    if limit < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {shown(limit)}", "max_tokens")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}, got {shown(req.n)}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):  # OpenAI's null and 0 both mean none
            raise APIError(400, f"{name} is not supported by this server (only 0)", name)
    top_k = None if req.top_k in (None, 0, -1) else req.top_k
    if top_k is not None and top_k < 0:
        raise APIError(400, f"top_k must be -1, 0 (off) or positive, got {shown(top_k)}", "top_k")
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: {shown(bad[0])} is outside the vocabulary [0, {state.vocab_size})",
                       "stop_token_ids")
    if any(not s for s in req.stop_strings):
        raise APIError(400, "a stop string must not be empty", "stop")
    if req.stop_strings and state.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer.json in the model folder; use stop_token_ids", "stop")
    try:
        params = SamplingParams(max_tokens=limit, temperature=req.temperature, top_k=top_k, top_p=req.top_p,
                                min_p=req.min_p, seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()),
                                ignore_eos=req.ignore_eos)
    except InvalidSamplingParam as e:
        raise APIError(400, str(e), e.field) from None
    if req.seed is not None and req.seed + req.n - 1 > SEED_MAX:  # choice j samples with seed + j
        raise APIError(400, f"seed must be <= {SEED_MAX} - (n - 1) with n {req.n} (choice j samples with "
                       "seed + j)", "seed")
    return params


# A prompt is tokenized on a worker thread (and a long one only as far as shows it cannot fit:
# serving/prompt_tokens.py), so a 10 MB text never holds up the event loop and /health.
def _check_room(state: ServerState, max_tokens: int) -> None:
    if max_tokens >= state.max_model_len:
        raise APIError(400, f"max_tokens is {shown(max_tokens)}; this model's context holds {state.max_model_len} "
                       "tokens, the prompt's included", "max_tokens")


async def _token_ids(state: ServerState, prompt: str | list[int], max_tokens: int) -> list[int]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise APIError(400, "a text prompt needs a tokenizer.json in the model folder; send token ids instead",
                           "prompt")
        prompt = await _encode(state, prompt, "prompt")
    return _check_ids(state, prompt, max_tokens, "prompt")


def _render(state: ServerState, req: ChatCompletionRequest) -> str:
    """The chat's prompt text (blocking: a worker thread renders a long conversation)."""
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
    try:
        return state.chat_template.render(messages, req.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None


async def _encode(state: ServerState, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    assert state.tokenizer is not None
    try:
        return await encode_prompt(state.tokenizer, text, state.max_model_len, add_special_tokens)
    except PromptTooLong as e:
        raise APIError(400, f"{e}; this model's context holds {state.max_model_len}", field) from None


def _check_ids(state: ServerState, ids: list[int], max_tokens: int, field: str) -> list[int]:
    """``ids`` unless empty, at or over the context, outside the vocabulary, or leaving no room
    for ``max_tokens`` (a 400 on ``max_tokens`` then, as vLLM answers)."""
    if not ids:
        raise APIError(400, "the prompt is empty: a request needs at least one token", field)
    if len(ids) >= state.max_model_len:
        raise APIError(400, context_message(len(ids), state.max_model_len), field)
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token id {shown(bad[0])} is outside the vocabulary [0, {state.vocab_size})", field)
    if len(ids) + max_tokens > state.max_model_len:
        raise APIError(400, f"max_tokens is {max_tokens}, but the prompt has {len(ids)} tokens and this model's "
                       f"context holds {state.max_model_len}: at most {state.max_model_len - len(ids)} can be "
                       "generated", "max_tokens")
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
    except InvalidSamplingParam as e:
        raise APIError(400, str(e), e.field) from None
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

