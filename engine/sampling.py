"""Sampling parameters and the sampler: greedy, temperature, top-k, min-p, top-p, per-request seeds
and logits processors.

``SamplingParams`` refuses bad values when it is built (``InvalidSamplingParam``, naming the
field), so a request with a NaN temperature never reaches a step. ``sample_each`` draws one
token per request and isolates them: a request whose logits processor raises, whose logits are
not finite or whose draw fails gets an error instead of a token, and the others are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy (vLLM's rule): dividing by it would overflow the logits."""

MAX_TEMPERATURE = 100.0
"""The largest temperature taken (OpenAI's API stops at 2; far above, every draw is uniform noise)."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds are 64-bit signed integers (vLLM's range)."""

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""vLLM's per-request hook: ``(output_token_ids, logits [vocab] float32) -> logits [vocab]``,
called before each of the request's draws (greedy ones included)."""


class InvalidSamplingParam(ValueError):
    """A sampling value out of its range (NaN, infinite, negative...); ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each request's next tokens (vLLM's names and defaults).

    ``temperature`` below ``SAMPLING_EPS`` (0 included) is greedy, at most ``MAX_TEMPERATURE``.
    ``top_k`` of None or 0, ``top_p == 1`` and ``min_p == 0`` disable those filters. ``seed`` (a
    signed 64-bit integer) makes a sampled request reproducible on its own. Generation stops
    after ``max_tokens`` tokens, on EOS (unless ``ignore_eos``) or on any of ``stop_token_ids``.
    ``logits_processors`` run in order on the request's logits before each draw.
    Raises ``InvalidSamplingParam`` for a value out of range or of the wrong type.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    logits_processors: tuple[LogitsProcessor, ...] = ()

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, low=1)
        _real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.top_k is not None:
            _integer("top_k", self.top_k, low=0)
        _real("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _real("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _integer("seed", self.seed, SEED_MIN, SEED_MAX)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParam("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if not all(callable(f) for f in self.logits_processors):
            raise InvalidSamplingParam("logits_processors", "logits_processors must be callables")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _integer(field: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSamplingParam(field, f"{field} must be an integer, got {type(value).__name__}")
    if low is not None and high is not None and not low <= value <= high:
        raise InvalidSamplingParam(field, f"{field} must be in [{low}, {high}], got {_shown(value)}")
    if low is not None and value < low:
        raise InvalidSamplingParam(field, f"{field} must be >= {low}, got {_shown(value)}")


def _real(field: str, value: object, low: float, high: float, open_low: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidSamplingParam(field, f"{field} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidSamplingParam(field, f"{field} must be a finite number, got {value}")
    if open_low and not low < value <= high:
        raise InvalidSamplingParam(field, f"{field} must be in ({low:g}, {high:g}], got {_shown(value)}")
    if value < low:
        raise InvalidSamplingParam(field, f"{field} must be >= {low:g}, got {_shown(value)}")
    if value > high:
        raise InvalidSamplingParam(field, f"{field} must be <= {high:g}, got {_shown(value)}")


def _shown(value: int | float) -> str:
    """``value`` for a one-line message (a JSON integer may have thousands of digits)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return str(value)


# ----- the sampler ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sampled:
    """One request's draw: ``token``, or ``error`` (one line) when it could not be drawn.
    ``model_fault``: the model's own logits were not finite, so its KV may not be either."""

    token: int | None
    error: str | None = None
    model_fault: bool = False


def sample_each(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                outputs: Sequence[Sequence[int]]) -> list[Sampled]:
    """One draw per row of ``logits`` ``[N, vocab]`` (float32) under ``params[i]``, ``outputs[i]``
    being that request's generated ids so far (for its logits processors). A row fails alone:
    its processors raised or returned something else than a ``[vocab]`` tensor, its logits
    hold NaN or +inf or are all -inf, or the draw raised. Never raises for a row's fault."""
    n = len(params)
    if not n:
        return []
    top, best = logits.max(dim=-1)  # max carries NaN: one pass finds NaN, +inf and all -inf rows
    raw_bad, greedy = (~torch.isfinite(top)).tolist(), best.tolist()
    results: list[Sampled | None] = [None] * n
    final = logits
    for i, p in enumerate(params):
        if raw_bad[i]:
            results[i] = Sampled(None, "the model's logits hold NaN or infinity", model_fault=True)
        elif p.logits_processors:  # each gets a copy of its row: it may edit it in place
            row, error = _processed(logits[i].clone(), p.logits_processors, outputs[i])
            if error is not None:
                results[i] = Sampled(None, error)
                continue
            if final is logits:
                final = logits.clone()
            final[i] = row
            greedy[i] = int(row.argmax())
    for i, p in enumerate(params):
        if results[i] is not None:
            continue
        if not p.greedy:
            try:
                results[i] = Sampled(_sample_row(final[i], p, generators[i]))
            except Exception as e:  # one request's bad draw: fail it alone
                results[i] = Sampled(None, f"sampling failed: {_one_line(e)}")
        else:
            results[i] = Sampled(greedy[i])
    return [r for r in results if r is not None]


def _processed(row: torch.Tensor, processors: Sequence[LogitsProcessor],
               output_ids: Sequence[int]) -> tuple[torch.Tensor, str | None]:
    """``row`` after ``processors`` as float32 on its device, or the error (one line) they caused."""
    device, shape = row.device, row.shape
    try:
        for fn in processors:
            row = fn(list(output_ids), row)
            if not isinstance(row, torch.Tensor) or row.shape != shape:
                got = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
                return row, f"a logits processor returned {got}, not a tensor of shape {tuple(shape)}"
        row = row.to(device=device, dtype=torch.float32)
    except Exception as e:  # the request's own code: its failure is the request's alone
        return row, f"a logits processor raised {_one_line(e)}"
    if not bool(torch.isfinite(row.max())):
        return row, "the logits processors left NaN or infinity in the logits"
    return row, None


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row.float() / p.temperature
    if p.top_k:
        k = min(p.top_k, row.numel())
        kth = torch.topk(row, k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
