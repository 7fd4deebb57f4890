"""One streamed ``POST /v1/completions`` against an OpenAI-compatible server, timed on the wall clock.

The request body (``completion_body``) sends the prompt as token ids, greedy, ``ignore_eos``,
streamed with the usage chunk, and ``return_token_ids`` (vLLM's extra field: each streamed
choice then carries the new ``token_ids``). ``stream_completion`` parses the server-sent
events line by line (``data: {...}`` ... ``data: [DONE]``) and returns a ``Completion``: when
each token-carrying chunk came, the generated token ids, and the final usage. It never
raises for what the server does: a non-2xx status, an error event, a broken or unfinished
stream, or a connection failure is a ``Completion`` with ``error`` set (and ``status``, the
HTTP status, None when no response came).

``first_model`` is the start-up probe (``GET /v1/models``): the only place a connection
failure is an exception (ValueError, one line), since then no request can succeed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
INSTANCE_HEADER = "x-kvlayer-instance"
ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class Completion:
    """What one streamed completion gave. Times are seconds after the request was sent:
    ``token_times`` one per chunk that carried text or token ids (so ``token_times[0]`` is
    the TTFT), ``end_s`` when the stream ended or failed. ``token_ids``: the generated ids the
    server sent (empty if it sends none). ``prompt_tokens``/``completion_tokens``/
    ``cached_tokens``: the final usage chunk's counts (``cached_tokens`` from
    ``usage.prompt_tokens_details.cached_tokens``), None where the server sent none.
    ``instance``: the ``x-kvlayer-instance`` response header (which instance a ``kvlayer
    router`` chose), None without one. ``error`` None means it succeeded (2xx and the stream
    reached ``[DONE]``)."""

    status: int | None
    error: str | None
    token_times: tuple[float, ...] = ()
    token_ids: tuple[int, ...] = ()
    end_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    instance: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The JSON body of one request: ``prompt`` as token ids, exactly ``max_tokens`` greedy tokens."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def make_client(endpoint: str, api_key: str | None, timeout_s: float, connections: int) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` on ``endpoint`` (base URL, no trailing slash) with up to
    ``connections`` connections, ``api_key`` as a bearer token when given, and ``timeout_s``
    for connecting and between reads. The caller closes it (``async with``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=endpoint, headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits)


async def first_model(client: httpx.AsyncClient, name: str | None) -> str:
    """``name`` if given, else the first model id of ``GET /v1/models``. The request is made
    either way, so an unreachable server is found before any work: ValueError (one line) when
    it cannot be reached, or, without ``name``, when it answers non-2xx or lists no model."""
    url = f"{client.base_url}".rstrip("/") + MODELS
    try:
        resp = await client.get(MODELS)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url}: {network_reason(e)}") from None
    if name:
        return name
    if not resp.is_success:
        raise ValueError(f"GET {url}: HTTP {resp.status_code}: {error_message(resp.text)} "
                         "(name the model with --served-model-name)")
    try:
        models = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"GET {url}: not an OpenAI model list: {one_line(resp.text)[:ERROR_CHARS]}") from None
    if not models:
        raise ValueError(f"GET {url}: the server lists no model (name one with --served-model-name)")
    return models[0]


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> Completion:
    """Send ``body`` (see ``completion_body``) and read its stream to the end; never raises
    for the server's or the network's failures (see the module docstring)."""
    t0 = time.perf_counter()
    status: int | None = None
    instance: str | None = None
    state = _Stream()
    try:
        async with client.stream("POST", COMPLETIONS, json=body) as resp:
            status, instance = resp.status_code, resp.headers.get(INSTANCE_HEADER)
            if not resp.is_success:
                text = (await resp.aread()).decode(errors="replace")
                return Completion(status, error_message(text), end_s=time.perf_counter() - t0, instance=instance)
            async for line in resp.aiter_lines():
                if state.feed(line, lambda: time.perf_counter() - t0):
                    break
    except httpx.HTTPError as e:
        state.error = f"{type(e).__name__}: {network_reason(e)}"
    if state.error is None and not state.done:
        state.error = "the stream ended before data: [DONE]"
    return Completion(status, state.error, tuple(state.times), tuple(state.ids), time.perf_counter() - t0,
                      *state.usage, instance=instance)


class _Stream:
    """The parse state of one event stream."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.ids: list[int] = []
        self.usage: tuple[int | None, int | None, int | None] = (None, None, None)
        self.error: str | None = None
        self.done = False

    def feed(self, line: str, now: Any) -> bool:
        """Take one line of the stream; True when the stream is over (``[DONE]`` or an error)."""
        if not line.startswith("data:"):
            return False  # blank separators, comments, other fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            self.error = f"not JSON in the stream: {one_line(data)[:ERROR_CHARS]}"
            return True
        if not isinstance(chunk, dict):
            self.error = f"not a JSON object in the stream: {one_line(data)[:ERROR_CHARS]}"
            return True
        if chunk.get("error"):
            self.error = error_message(data)
            return True
        carried = False
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            self.ids.extend(int(i) for i in ids)
            carried = carried or bool(ids) or bool(choice.get("text"))
        if carried:
            self.times.append(now())
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            self.usage = (usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))
        return False


def error_message(text: str) -> str:
    """The message of an error body, as one line: OpenAI's ``{"error": {"message"}}``, a plain
    ``{"message"}``, FastAPI's ``{"detail"}``, else the text itself (cut to ``ERROR_CHARS``)."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    message: Any = text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            message = err["message"]
        elif isinstance(err, str) and err:
            message = err
        elif body.get("message"):
            message = body["message"]
        elif body.get("detail"):
            message = body["detail"]
    return one_line(str(message))[:ERROR_CHARS] or "(empty body)"


def network_reason(e: BaseException) -> str:
    """Why a request failed on the network, as one line: the system's words for the errno
    behind ``e`` ("Connection refused"), else ``e``'s own message, else its type's name."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return os.strerror(cause.errno)
        cause = cause.__cause__ or cause.__context__
    return one_line(str(e)) or type(e).__name__


def one_line(text: str) -> str:
    return " ".join(text.split())
