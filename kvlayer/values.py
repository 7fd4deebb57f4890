"""Typed configuration values: ``ConfigError`` and the kinds a setting can have.

Both the core's settings (``kvlayer/config.py``) and the tiers' own (``kvlayer/tier_settings.py``)
are parsed here, so a value means the same wherever it is written: YAML, a dict, Python or a
``KVLAYER_*`` environment variable (whose values are strings, converted to the setting's kind).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlayer.sizes import parse_size

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
"""The strings a bool setting accepts (case-insensitive)."""
_NONE = {"", "none", "null"}
OPTIONAL = " | None"
"""Suffix of a kind whose setting may be unset (``"str | None"``): None, "", "none" and "null" unset it."""


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names it, in one line."""


def boolean(value: Any) -> bool:
    """A bool, or a string such as "true"/"no"/"1"; ``ValueError`` otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise ValueError(f"{value!r} (expected bool)")


def integer(value: Any) -> int:
    """An int, or a string of digits (not a bool, nor a float such as 1.5); ``ValueError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{value!r} (expected int)")


def number(value: Any) -> float:
    """A float, an int or a numeric string; ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{value!r} (expected float)")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{value!r} (expected float)") from None


def text(value: Any) -> str:
    """A string (a number is written out: YAML reads ``prefix: 123`` or ``salt_quota: 0.25`` as
    one); ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} (expected str)")
    return str(value)


KINDS: dict[str, Callable[[Any], Any]] = {"bool": boolean, "int": integer, "float": number, "str": text,
                                          "size": parse_size}
"""Kind name -> parser (``ValueError`` with a message naming the value). ``size``: bytes, from an int
or a string such as "4GiB" (``kvlayer.sizes``). Any kind may end in ``OPTIONAL``."""


def check_kind(kind: str) -> None:
    """``ValueError`` unless ``kind`` is one of ``KINDS``, optionally followed by ``OPTIONAL``."""
    if kind.removesuffix(OPTIONAL) not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {sorted(KINDS)} (each may end in {OPTIONAL!r})")


def parse_value(label: str, kind: str, value: Any) -> Any:
    """``value`` as a setting of ``kind`` (see ``KINDS``), strings converted; ``ConfigError``
    naming ``label`` (the key as the user may write it) for a value that is not of that kind."""
    optional = kind.endswith(OPTIONAL)
    if value is None or (optional and isinstance(value, str) and value.lower() in _NONE):
        if optional:
            return None
        raise ConfigError(f"{label} must not be empty")
    try:
        return KINDS[kind.removesuffix(OPTIONAL)](value)
    except ValueError as e:  # its message says what is wrong: keep it
        raise ConfigError(f"invalid value for {label}: {e}") from None
