"""``type=`` functions for command-line numbers, shared by every ``kvlayer`` subcommand.

argparse calls them while parsing, before any work, and reports a failure as one line naming
the flag ("argument --port: a port is 0..65535, got 99999").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def _number(text: str, convert: Callable[[str], N], noun: str, ok: Callable[[N], bool], rule: str) -> N:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, "an integer", lambda v: v >= 1, "must be positive")


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: any free one)."""
    return _number(text, int, "a port number", lambda v: 0 <= v <= 65535, "a port is 0..65535")


def positive_float(text: str) -> float:
    """A number > 0 (``inf`` allowed)."""
    return _number(text, float, "a number", lambda v: v > 0, "must be positive")


def nonnegative_float(text: str) -> float:
    """A number >= 0."""
    return _number(text, float, "a number", lambda v: v >= 0, "must be >= 0")
