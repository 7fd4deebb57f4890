"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` and OpenAI's error JSON.

Fields are OpenAI's, plus vLLM's extras (``cache_salt``, ``return_token_ids``,
``ignore_eos``, ``top_k``, ``min_p``, ``stop_token_ids``). Types are strict (``"5"`` is not a
number); the sampling values' ranges (NaN and infinity included) are checked where they become
the engine's ``SamplingParams`` (serving/completions.py), each refusal naming its field.
Unknown fields are ignored, as OpenAI's own server and vLLM's do, except the known ones this
server does not implement, which are refused when set (``UNSUPPORTED``) rather than silently
dropped. Every refusal is an ``APIError``: status, one-line message, OpenAI error type.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_N = 16
"""Most choices per prompt (``n``)."""
MAX_PROMPTS = 256
"""Most prompts in one ``/v1/completions`` batch."""
MAX_MODEL_LEN = "max_model_len"
"""The validation context key (``model_validate(data, context={MAX_MODEL_LEN: n})``) that
refuses a token-id prompt of ``n`` or more ids by its length alone, before its ids are read."""

UNSUPPORTED: dict[str, Any] = {"logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
                               "logit_bias": None, "tools": None, "functions": None, "response_format": None}
"""Fields this server refuses (400) unless they carry OpenAI's default (given here). The
penalties are fields of their own, refused unless 0 when the sampling values are checked."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
               503: "service_unavailable"}


class APIError(Exception):
    """An answer of ``status`` with OpenAI's error JSON (``body()``)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


class FieldError(ValueError):
    """A validator's refusal of ``field``: ``validation_message`` names it as the ``param``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def context_message(tokens: int, max_model_len: int) -> str:
    """Why a prompt of ``tokens`` tokens (or more) is refused by a context of ``max_model_len``."""
    return (f"the prompt has {tokens} tokens; this model's context holds {max_model_len} "
            "(one more is needed to generate)")


def shown(value: int) -> str:
    """``value`` for a one-line message: a JSON integer may have thousands of digits."""
    return str(value) if abs(value) < 10**20 else f"an integer of {len(str(abs(value)))} digits"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, ``code`` being the HTTP status."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class GenerationRequest(BaseModel):
    """What both endpoints share: sampling, streaming, kvlayer's and vLLM's extras."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt | None = None
    min_p: Number = 0.0
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = None
    return_token_ids: StrictBool = False
    ignore_eos: StrictBool = False
    user: StrictStr | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's field for disaggregated prefill; ``{"do_remote_decode": true}``: answer only once
    kvlayer has written this prompt's KV to every tier (the shared one included)."""

    @model_validator(mode="after")
    def _check(self) -> GenerationRequest:
        extra = self.model_extra or {}
        for name, default in UNSUPPORTED.items():
            if extra.get(name, default) not in (default, None):
                raise FieldError(name, f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options needs stream: true")
        if self.cache_salt == "":
            raise FieldError("cache_salt", "cache_salt must not be empty (leave it out instead)")
        if self.remote_decode and self.stream:
            raise FieldError("kv_transfer_params", "kv_transfer_params.do_remote_decode needs stream: false")
        return self

    @property
    def remote_decode(self) -> bool:
        return bool((self.kv_transfer_params or {}).get("do_remote_decode"))

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int | None:
        return self.max_tokens


TokenIds = list[StrictInt]


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a text, a list of token ids, or a batch of either."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value: Any, info: ValidationInfo) -> Any:
        """Sizes first, each in O(1): an empty list, a batch over ``MAX_PROMPTS``, a token-id
        prompt that cannot fit the context (``MAX_MODEL_LEN`` in the context)."""
        if not isinstance(value, list):
            return value
        if not value:
            raise FieldError("prompt", "prompt must not be an empty list")
        batch = isinstance(value[0], (str, list))
        if batch and len(value) > MAX_PROMPTS:
            raise FieldError("prompt", f"a batch holds at most {MAX_PROMPTS} prompts, got {len(value)}")
        max_model_len = (info.context or {}).get(MAX_MODEL_LEN)
        longest = max((len(p) for p in value if isinstance(p, list)), default=0) if batch else len(value)
        if max_model_len is not None and longest >= max_model_len:
            raise FieldError("prompt", context_message(longest, max_model_len))
        # the union's members would each report every bad item: one line instead, at once
        kinds = {type(p) for p in value} if batch else set()
        if batch and len(kinds) > 1:
            raise FieldError("prompt", "a batch must be all texts or all lists of token ids")
        for ids in (value if kinds == {list} else [] if batch else [value]):
            bad = next((i for i, t in enumerate(ids) if type(t) is not int), None)
            if bad is not None:
                raise FieldError("prompt", f"prompt: item {bad} of a token-id list is not an integer")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch: one item per prompt, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        """The content as one string (text parts joined with newlines; None is "")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is an alias of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    add_generation_prompt: StrictBool = True

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first of pydantic's (or FastAPI's) validation errors as one line, and the field it names."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union reports each member's failure with the member in the path: keep the field names
    field = ".".join(p for p in loc if not p.startswith(("list[", "str", "int", "float", "bool"))
                     and not p.endswith("]") and "function-" not in p)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    named = getattr(first.get("ctx", {}).get("error"), "field", None)
    if isinstance(named, str):  # a validator's FieldError (or any error with a field)
        return msg, named
    if first.get("type") == "json_invalid":
        return f"malformed JSON: {first.get('ctx', {}).get('error', msg)}", None
    if first.get("type") == "missing":
        return f"{field} is required", field or None
    return (f"{field}: {msg}" if field else msg), field or None
