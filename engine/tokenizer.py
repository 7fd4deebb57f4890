"""Text <-> token ids for the engine: a thin wrapper over a model folder's ``tokenizer.json``.

``Tokenizer.from_dir(folder)`` loads it (``None`` when the folder has none: the engine then
takes token ids only). ``byte_tokenizer()`` builds the one-token-per-byte tokenizer that the
random-weight presets ship, so tests and demos round-trip any text without downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"


class Tokenizer:
    """Encodes text with the file's own special-token rules and decodes without special tokens."""

    def __init__(
        self, inner: tokenizers.Tokenizer, eos_token_id: int | None, bos_token_id: int | None = None
    ) -> None:
        self._inner = inner
        self._eos_token_id = eos_token_id
        self._bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of folder ``path``, or None without ``tokenizer.json``. Special tokens
        come from ``tokenizer_config.json`` (``eos_token``/``bos_token``), else ``config.json``'s ids."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            return None
        inner = tokenizers.Tokenizer.from_file(str(file))
        return cls(inner, _special_id(folder, inner, "eos"), _special_id(folder, inner, "bos"))

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (special tokens included)."""
        return self._inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with whatever special tokens the tokenizer's post-processor adds
        unless ``add_special_tokens`` is False (a chat template places its own)."""
        return self._inner.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each of ``texts``; the tokenizer's own work runs without the GIL (unlike
        ``encode``'s), so on a worker thread it leaves the other threads running."""
        return [e.ids for e in self._inner.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return self._inner.decode(list(ids), skip_special_tokens=True)


def _special_id(folder: Path, inner: tokenizers.Tokenizer, kind: str) -> int | None:
    settings = _read_json(folder / "tokenizer_config.json")
    token = settings.get(f"{kind}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and inner.token_to_id(token) is not None:
        return inner.token_to_id(token)
    value = _read_json(folder / "config.json").get(f"{kind}_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    value = json.loads(file.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _byte_symbols() -> list[str]:
    """One printable character per byte value (byte-level BPE's alphabet), indexed by byte.

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255, so every
    symbol survives JSON and whitespace handling.
    """
    ranges = (("!", "~"), ("\u00a1", "\u00ac"), ("\u00ae", "\u00ff"))
    printable = [b for first, last in ranges for b in range(ord(first), ord(last) + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def byte_tokenizer() -> tokenizers.Tokenizer:
    """A tokenizer with token id ``b`` for byte ``b`` (0..255), then ``<bos>`` = 256, ``<eos>`` = 257.

    Encoding adds no special tokens; decoding reassembles the UTF-8 bytes.
    """
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    return inner
