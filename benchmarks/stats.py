"""Pure arithmetic of the benchmarks: percentiles, summaries of latencies, crossover lengths.

Nothing here measures or imports torch, so the tests check it directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between ranks
    (numpy's default). ValueError for no values or ``q`` outside [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (all NaN when there are none)."""
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p99"), math.nan)
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


class Crossover(NamedTuple):
    """Where loading a cached prefix starts to beat recomputing it.

    ``kind`` is "between" (``length`` interpolated between two measured lengths), "below"
    (loading wins at every measured length: the crossover lies below ``length``, the
    shortest) or "never" (recomputing wins at the longest measured ``length``).
    """

    length: float
    kind: str

    def text(self) -> str:
        if self.kind == "below":
            return f"< {self.length:,.0f}"
        if self.kind == "never":
            return f"> {self.length:,.0f} (never)"
        return f"~{self.length:,.0f}"


def crossover(lengths: Sequence[int], recompute_s: Sequence[float], load_s: Sequence[float]) -> Crossover:
    """The prefix length below which recomputing is cheaper than loading.

    ``lengths`` ascending; ``recompute_s[i]``/``load_s[i]`` the TTFT at ``lengths[i]`` without and
    with the prefix loaded. Loading wins from the first length after the last one where it
    loses; the crossover is interpolated linearly on (load - recompute) between those two.
    ValueError for empty or mismatched inputs or unsorted lengths.
    """
    if not lengths or not len(lengths) == len(recompute_s) == len(load_s):
        raise ValueError("crossover needs equally long, non-empty sequences")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths must be strictly ascending, got {list(lengths)}")
    diff = [lo - re for lo, re in zip(load_s, recompute_s)]
    losing = [i for i, d in enumerate(diff) if d >= 0]
    if not losing:
        return Crossover(float(lengths[0]), "below")
    last = losing[-1]
    if last == len(lengths) - 1:
        return Crossover(float(lengths[-1]), "never")
    d0, d1 = diff[last], diff[last + 1]
    frac = d0 / (d0 - d1) if d0 != d1 else 0.0
    return Crossover(lengths[last] + frac * (lengths[last + 1] - lengths[last]), "between")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
