"""Byte sizes written as "512MiB", "4GiB", "1.5GB" or plain integers."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_RE = re.compile(r"^\s*(-?)([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_EXAMPLES = "e.g. 4GiB, 512MiB, 1000000"


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string; ValueError for anything else, its message naming the
    value and what is wrong with it (negative, unknown unit, not a size at all)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r} (expected {_EXAMPLES})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r} (expected {_EXAMPLES})")
    m = _RE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (expected {_EXAMPLES})")
    sign, number, unit = m.groups()
    if unit.lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (unknown unit {unit!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")
    if sign:
        raise ValueError(f"a size must be >= 0, got {value!r}")
    return int(float(number) * _UNITS[unit.lower()])


def format_size(n: int) -> str:
    """A short human string for ``n`` bytes (binary units)."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"
