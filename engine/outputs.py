"""What the engine returns for a request (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlayer.engine.sequence import RequestTimes


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state: final when ``finished``.

    ``num_cached_tokens`` counts prompt tokens served by the engine's own prefix cache and
    ``num_external_tokens`` those loaded through the connector (kvlayer), at admission.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int
    num_external_tokens: int
    metrics: RequestTimes
