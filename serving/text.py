"""Token ids to streamed text, and stop strings, for one choice of one request.

``TextStream.add(ids)`` takes a choice's new token ids and returns the text that may be sent
now. Text is decoded incrementally over a short window (as vLLM does), so a character split
over several byte-level tokens is sent once it is whole, never as U+FFFD. With stop strings,
the tail that could still become a stop string is held back; when one appears the text is
cut just before it and ``stopped`` is set (the caller then aborts the request). Whatever is
held back is released by ``finish()``. So the streamed pieces always add up to the text a
non-streamed answer carries.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlayer.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one choice. Without a tokenizer every piece is "" (token ids only)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer.json in the model folder; use stop_token_ids")
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix = 0  # the window decoded for context starts here
        self._read = 0  # tokens up to here have been turned into text
        self.text = ""
        """Everything decoded so far (cut at a stop string), sent or held back."""
        self._sent = 0
        self.stopped = False
        """A stop string was found: ``text`` ends just before it."""

    def add(self, token_ids: Sequence[int]) -> str:
        """The text to send after ``token_ids`` (may be ""); nothing once ``stopped``."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        if self._tok is None:
            return ""
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once the request has ended (held-back tails included)."""
        if self.stopped or self._tok is None:
            return ""
        self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        assert self._tok is not None
        if self._read == len(self._ids):
            return
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith(_REPLACEMENT)):
            start = len(self.text)
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        longest = max((len(s) for s in self._stop), default=0)
        if not longest:
            return
        begin = max(0, start - longest + 1)
        hits = [i for i in (self.text.find(s, begin) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held_tail()
        end = max(end, self._sent)
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _held_tail(self) -> int:
        """Length of the longest tail of ``text`` that is the start of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
