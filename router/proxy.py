"""Forwarding one generation request: choose, send, retry once, stream back; and P/D.

``Router.forward(path, body)`` finds the up instances serving ``body["model"]``, asks the
controller what each caches of the prompt (``kv`` policy only, one ``Lookup`` with a
deadline), ranks them (``Policy``) and sends the body, unchanged, to the best one. An
instance that refuses the connection, or fails before the first byte of its answer, leaves
the routing set and the request goes once to the next best. A stream that breaks after its
first byte ends with an error event and ``data: [DONE]``. Every answer carries
``x-kvlayer-instance``.

With ``pd`` the prompt first goes to a prefill instance as ``max_tokens: 1`` with
``kv_transfer_params: {"do_remote_decode": true}``, which answers once its KV is in the
shared tier; the request then goes to a decode instance, which loads that KV. Without a
prefill or a decode instance up, the request is served colocated.

Per request: at most one controller call and no instance reads (loads are probed in the
background, fleet.py), plus the one or two requests forwarded. A prompt the router tokenizes
itself (``--tokenizer``) is rendered and tokenized on a worker thread. How the last request
was routed, and why by load when it was, is ``Router.status`` (routing_status.py: ``/health``
shows it, and the falls back to load are logged, a failed lookup rate limited).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

import httpx
from starlette.responses import Response, StreamingResponse

from kvlayer.router.controller_view import ControllerView, PrefixHit
from kvlayer.router.fleet import ROLES, Fleet, Instance
from kvlayer.router.metrics import RouterMetrics
from kvlayer.router.policy import Policy
from kvlayer.router.routing_status import RoutingStatus, Throttled
from kvlayer.serving.prompt_tokens import PromptTooLong, encode_prompt
from kvlayer.serving.protocol import APIError, error_body

log = logging.getLogger(__name__)

INSTANCE_HEADER = "x-kvlayer-instance"
PREFILL_HEADER = "x-kvlayer-prefill-instance"
ATTEMPTS = 2
LOOKUP_MAX_TOKENS = 131_072
"""The longest prompt the router tokenizes to look up (the controller's default ``--max-tokens``)."""


class _Prompt(NamedTuple):
    """A prompt as the controller's lookup takes it: token ids, or text it tokenizes; neither
    (``why_not`` says why) when the router cannot look it up."""

    ids: list[int] | None = None
    text: str | None = None
    why_not: str = ""


class Router:
    """The forwarding logic over ``fleet`` (see the module docstring). ``tokenizers`` maps a
    served model name to ``(Tokenizer, ChatTemplate)`` for prompts the router tokenizes itself."""

    def __init__(self, fleet: Fleet, view: ControllerView, policy: Policy, metrics: RouterMetrics,
                 pd: bool = False, tokenizers: dict[str, Any] | None = None) -> None:
        self.fleet = fleet
        self.view = view
        self.policy = policy
        self.metrics = metrics
        self.pd = pd
        self.tokenizers = tokenizers or {}
        self.status = RoutingStatus(policy.name, log, Throttled(log))

    async def forward(self, path: str, body: dict[str, Any]) -> Response:
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model is required (a string)", "model")
        stream = body.get("stream") is True
        if self.pd:
            prefills = self.fleet.candidates(model, ("prefill",))
            decodes = self.fleet.candidates(model, ("decode",))
            if prefills and decodes:
                hits = await self._lookup(model, body, path, prefills)
                prefilled = await self._prefill(path, body, self.policy.rank(prefills, hits))
                answer = await self._send(path, body, self.policy.rank(decodes, None), stream)
                if prefilled is not None:
                    answer.headers[PREFILL_HEADER] = prefilled
                return answer
            self.metrics.pd_colocated.inc()
        candidates = self.fleet.candidates(model, ROLES)
        if not candidates:
            if not self.fleet.knows(model):
                raise APIError(404, f"the model {model!r} does not exist; the fleet serves {self.fleet.models()}",
                               "model")
            raise APIError(503, f"no instance serving {model!r} is up")
        hits = await self._lookup(model, body, path, candidates)
        return await self._send(path, body, self.policy.rank(candidates, hits), stream)

    # ----- choosing -----------------------------------------------------------------------
    async def _lookup(self, model: str, body: dict[str, Any], path: str,
                      candidates: Sequence[Instance]) -> dict[str, PrefixHit] | None:
        if not self.policy.needs_lookup:
            return None
        prompt = await self._prompt(model, body, path)
        if prompt.ids is None and prompt.text is None:
            self.status.by_load(prompt.why_not)
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        with self.metrics.lookup_seconds.time():
            hits = await self.view.lookup(candidates[0].model_name, prompt.ids, prompt.text, salt)
        if hits is None:
            self.metrics.lookup_failures.inc()
            self.status.lookup_failed(model, self.view.last_failure)
        else:
            self.status.by_prefix()
        return hits

    async def _prompt(self, model: str, body: dict[str, Any], path: str) -> _Prompt:
        """The prompt to look up: token ids (the router's own tokenizer for the model, if any,
        on a worker thread) or text for the controller to tokenize; neither, and why, when
        the router cannot tell (a chat without a tokenizer for the model, a malformed prompt)."""
        tok = self.tokenizers.get(model)
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if tok is None:
                return _Prompt(why_not=f"chat prompts of {model!r} are not looked up without --tokenizer "
                               f"{model}=DIR")
            if not isinstance(messages, list):
                return _Prompt(why_not="a chat request without a list of messages")
            try:
                text = await asyncio.to_thread(_render, tok[1], messages, body.get("add_generation_prompt"))
            except (ValueError, TypeError, AttributeError):
                return _Prompt(why_not="a chat prompt the router cannot render")
            return await _encoded(tok[0], text, add_special_tokens=tok[1].fallback)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return _Prompt(ids=list(prompt))
        if isinstance(prompt, str) and prompt:
            return await _encoded(tok[0], prompt) if tok is not None else _Prompt(text=prompt)
        return _Prompt(why_not="a prompt that is empty or neither text nor token ids")

    # ----- sending ------------------------------------------------------------------------
    async def _prefill(self, path: str, body: dict[str, Any], ranked: list[Instance]) -> str | None:
        """Run the prompt on a prefill instance until its KV is written; its id, or None."""
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "max_completion_tokens")}
        pre.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        answer = await self._send(path, pre, ranked, stream=False)
        self.metrics.pd_prefills.inc()
        if answer.status_code != 200:
            log.warning("kvlayer router: the prefill failed (HTTP %d); the decode instance computes the prompt",
                        answer.status_code)
            return None
        return answer.headers.get(INSTANCE_HEADER)

    async def _send(self, path: str, body: dict[str, Any], ranked: list[Instance], stream: bool) -> Response:
        content = json.dumps(body).encode()
        failures = []
        for inst in ranked[:ATTEMPTS]:
            if failures:
                self.metrics.retries.inc()
            inst.inflight += 1
            try:
                answer = await self._try(inst, path, content, stream)
            except httpx.TransportError as e:
                inst.inflight -= 1
                self.fleet.mark_down(inst, f"{type(e).__name__} before answering")
                failures.append(f"{inst.instance_id}: {type(e).__name__}")
                continue
            inst.routed += 1
            self.metrics.requests.labels(inst.instance_id).inc()
            return answer
        raise APIError(502, f"no instance answered ({'; '.join(failures) or 'none up'})")

    async def _try(self, inst: Instance, path: str, content: bytes, stream: bool) -> Response:
        """Send to ``inst``; raises ``httpx.TransportError`` only before its first byte came."""
        request = self.fleet.http.build_request("POST", f"{inst.url}{path}", content=content,
                                                headers={**self.fleet.headers, "content-type": "application/json"})
        upstream = await self.fleet.http.send(request, stream=True)
        headers = {INSTANCE_HEADER: inst.instance_id}
        kind = upstream.headers.get("content-type", "application/json")
        if not (stream and kind.startswith("text/event-stream")):
            try:
                data = await upstream.aread()
            finally:
                await upstream.aclose()
                inst.inflight -= 1
            return Response(data, status_code=upstream.status_code, media_type=kind, headers=headers)
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except BaseException:
            await upstream.aclose()
            raise
        return StreamingResponse(self._relay(inst, upstream, first, chunks), status_code=upstream.status_code,
                                 media_type=kind, headers=headers)

    async def _relay(self, inst: Instance, upstream: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as e:
            self.fleet.mark_down(inst, f"{type(e).__name__} mid-stream")
            self.metrics.stream_errors.inc()
            message = f"instance {inst.instance_id} failed mid-stream: {type(e).__name__}"
            yield f"\n\ndata: {json.dumps(error_body(502, message))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            inst.inflight -= 1


def _render(template: Any, messages: list[Any], add_generation_prompt: Any) -> str:
    """The chat's prompt text by ``template`` (blocking: run on a worker thread)."""
    items = [{**m, "content": _text(m.get("content"))} for m in messages if isinstance(m, dict)]
    return template.render(items, add_generation_prompt is not False)


async def _encoded(tokenizer: Any, text: str, add_special_tokens: bool = True) -> _Prompt:
    try:
        return _Prompt(ids=await encode_prompt(tokenizer, text, LOOKUP_MAX_TOKENS, add_special_tokens))
    except PromptTooLong:
        return _Prompt(why_not=f"a prompt longer than {LOOKUP_MAX_TOKENS} tokens is not looked up")


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
