"""What the engine returns for a request (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlayer.engine.sequence import RequestTimes


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sampled continuation: ``token_ids`` generated so far, the stop token included (EOS
    or a ``stop_token_ids`` token ends it and is its last id); ``text`` their decoding when the
    model has a tokenizer; ``finish_reason`` ``"stop"``, ``"length"``, ``"abort"`` (aborted by
    the caller), ``"error"`` (this request alone failed: ``error`` says why, in one line; the
    tokens before the failure are kept) or None while running."""

    index: int
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state: final when ``finished``.

    ``num_cached_tokens`` counts prompt tokens served by the engine's own prefix cache and
    ``num_external_tokens`` those loaded through the connector (kvlayer), at admission.
    ``metrics`` is the request's live timing record: an output taken mid-run shows later
    times (first token, finish) once they happen.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int
    num_external_tokens: int
    metrics: RequestTimes
