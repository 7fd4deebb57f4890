"""Turning an admin request's ``Prefix`` into checked token ids (and a salt).

Token ids are taken as given (bounded and range-checked); text is tokenized with the model's
``tokenizer.json`` when the controller was given one (``--tokenizer MODEL=PATH``), the same
file the engine encodes prompts with, so both produce the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import wire
from kvlayer.controller.errors import exhausted, invalid

TEXT_BYTES_PER_TOKEN = 16
"""Text longer than ``max_tokens`` times this many bytes is refused before tokenizing."""


class PrefixReader:
    """Checks prefixes against ``max_tokens``; ``tokenizers`` maps model name -> tokenizer path."""

    def __init__(self, max_tokens: int, tokenizers: Sequence[tuple[str, str]] = ()) -> None:
        self.max_tokens = max_tokens
        self._paths = {model: _tokenizer_file(path) for model, path in tokenizers}
        self._loaded: dict[str, Any] = {}

    def tokens(self, prefix: pb.Prefix, model: str, aliases: Sequence[str] = ()) -> list[int]:
        """The prefix's token ids (for text, the tokenizer of ``model``, else of the first of its other
        names, ``aliases``, that has one); RequestError if malformed."""
        if prefix.text and prefix.token_ids:
            raise invalid("send token_ids or text, not both")
        if not prefix.text:
            return wire.check_tokens(prefix.token_ids, self.max_tokens)
        if len(prefix.text) > self.max_tokens * TEXT_BYTES_PER_TOKEN:
            raise exhausted(f"text of {len(prefix.text)} characters exceeds the limit")
        named = next((m for m in (model, *aliases) if m in self._paths), model)
        return wire.check_tokens(self._tokenizer(named).encode(prefix.text).ids, self.max_tokens)

    @staticmethod
    def salt(prefix: pb.Prefix) -> str | None:
        """The prefix's cache salt, None when absent (the instance's default applies)."""
        if not prefix.HasField("cache_salt"):
            return None
        return wire.check_text(prefix.cache_salt, "prefix.cache_salt")

    @staticmethod
    def is_empty(prefix: pb.Prefix) -> bool:
        """Whether the prefix carries neither token ids nor text."""
        return not prefix.token_ids and not prefix.text

    def _tokenizer(self, model: str) -> Any:
        if model not in self._paths:
            raise invalid(f"text needs a tokenizer for model {model[:80]!r} (kvlayer controller --tokenizer); "
                          "send token_ids instead")
        if model not in self._loaded:
            import tokenizers

            self._loaded[model] = tokenizers.Tokenizer.from_file(str(self._paths[model]))
        return self._loaded[model]


def _tokenizer_file(path: str) -> Path:
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p
