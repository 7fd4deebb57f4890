"""Prompt text to token ids off the event loop, stopping early once it cannot fit.

``encode_prompt(tokenizer, text, limit)`` tokenizes on a worker thread, through
``encode_batch`` (the tokenizer's Rust code runs without the GIL), so the event loop, and with
it ``/health`` and every other connection, goes on meanwhile. A text far longer than ``limit``
tokens is not tokenized whole: its first ``CHARS_PER_TOKEN * limit`` characters are, then four
times as many, and so on; as soon as such a prefix has ``limit + SLACK`` tokens,
``PromptTooLong`` says so (a 10 MB text against a 4,096-token context is refused after its
first 32 KB). ``SLACK`` covers a prefix cut inside a word tokenizing into more pieces than
that word does whole, so the prompt itself has at least ``limit`` tokens.

This module imports nothing of the engine (the router uses it with its own tokenizers).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

CHARS_PER_TOKEN = 8
"""The first prefix tried holds this many characters per token of the limit."""
GROWTH = 4
SLACK = 32


class Encoder(Protocol):
    """What ``encode_prompt`` needs of a tokenizer (``kvlayer.engine.tokenizer.Tokenizer``)."""

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]: ...


class PromptTooLong(ValueError):
    """The text has at least ``tokens`` tokens: so many were counted in its first ``chars``
    characters (less ``SLACK``)."""

    def __init__(self, tokens: int, chars: int) -> None:
        super().__init__(f"the prompt has more than {tokens} tokens (counted in its first {chars} characters)")
        self.tokens = tokens
        self.chars = chars


def encode_within(tokenizer: Encoder, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """The token ids of ``text``, or ``PromptTooLong`` once a prefix shows it has ``limit`` or
    more (see the module docstring). Blocking: call it on a worker thread."""
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    size = CHARS_PER_TOKEN * limit
    while size < len(text):
        cut = _cut(text, size)
        counted = len(tokenizer.encode_batch([text[:cut]], add_special_tokens)[0])
        if counted >= limit + SLACK:
            raise PromptTooLong(counted - SLACK, cut)
        size *= GROWTH
    return tokenizer.encode_batch([text], add_special_tokens)[0]


async def encode_prompt(tokenizer: Encoder, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """``encode_within`` on a worker thread."""
    return await asyncio.to_thread(encode_within, tokenizer, text, limit, add_special_tokens)


def _cut(text: str, size: int) -> int:
    """Where to cut ``text`` near ``size``: before a whitespace in the prefix's second half, if
    any, so a word-splitting tokenizer sees the same words as in the whole text."""
    space = max(text.rfind(" ", size // 2, size), text.rfind("\n", size // 2, size))
    return space if space > 0 else size
