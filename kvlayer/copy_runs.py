"""Runs of copy pieces that lie one stride apart in one buffer, for ``CopyPlan``'s CPU scatter.

kvlayer's chunks are separate objects, so a scatter of n chunks over L layers is n x L copy
ops where the engine's own copy of the same rows would be L; on the CPU each op is a parallel
region of torch's, with a fork and join of its threads. Chunks a tier allocated one after
another in its arena (``kvlayer.memory.Arena`` hands out its lowest free slot first) lie at
one stride: per layer, one strided view covers all of them, ``[planes, count, n, row]``, and one
indexed assignment (``index_put_``) writes it into the cache at a ``[count, n]`` slot table
(measured in docs/benchmarks.md, "Runs: one scatter op per layer").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 16
"""Bytes a run's stride is a multiple of: that of the widest element a view may use."""


@dataclass(frozen=True, slots=True)
class Run:
    """Pieces ``first .. first + count - 1`` of a plan: equal shapes, strides, dtypes, layers and
    slot counts, in one storage, each ``stride`` bytes (> 0) after the one before."""

    first: int
    count: int
    stride: int

    @property
    def pieces(self) -> range:
        return range(self.first, self.first + self.count)


def find_runs(chunks: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
              layers: Sequence[tuple[int, ...]]) -> list[Run]:
    """The runs of two or more consecutive host pieces (``CopyPlan``'s ``(chunk, slots)`` and
    each piece's layer ids), in order; a piece in no run is not listed."""
    runs: list[Run] = []
    i = 0
    while i < len(chunks):
        end, stride = i + 1, 0
        while end < len(chunks) and _alike(chunks[i], chunks[end], slots[i], slots[end], layers[i], layers[end]):
            delta = chunks[end].data_ptr() - chunks[end - 1].data_ptr()
            if delta <= 0 or delta % ALIGN or (stride and delta != stride):
                break
            stride, end = delta, end + 1
        if end - i > 1:
            runs.append(Run(i, end - i, stride))
        i = end
    return runs


def _alike(a: torch.Tensor, b: torch.Tensor, slots_a: torch.Tensor, slots_b: torch.Tensor,
           layers_a: tuple[int, ...], layers_b: tuple[int, ...]) -> bool:
    return (a.is_cpu and b.is_cpu and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and layers_a == layers_b and slots_a.shape == slots_b.shape
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def run_view(first: torch.Tensor, run: Run) -> torch.Tensor:
    """``[planes, count, n, row]``: the run's rows of one layer, from ``first`` ``[planes, n, row]``,
    that layer of its first piece (any element dtype whose size divides the stride)."""
    planes, rows, elements = first.stride()
    return first.as_strided((first.shape[0], run.count, first.shape[1], first.shape[2]),
                            (planes, run.stride // first.element_size(), rows, elements), first.storage_offset())


RunPart = tuple[torch.Tensor, dict[int, torch.Tensor]]
"""A run ready to copy: its ``[count, n]`` slots (one row per piece) and its ``run_view`` per layer."""


def run_parts(wide: Sequence[dict[int, torch.Tensor] | None], slots: Sequence[torch.Tensor],
              runs: Sequence[Run]) -> tuple[list[RunPart], list[int]]:
    """The ``runs`` whose every piece has wide layer views (``wide[i]``: layer -> ``[planes, n,
    row]``, or None), ready to copy, and the pieces in none of those, in order."""
    parts, alone = [], set(range(len(wide)))
    for run in runs:
        first = wide[run.first]
        if first is not None and all(wide[i] is not None for i in run.pieces):
            table = torch.stack([slots[i] for i in run.pieces])
            parts.append((table, {layer: run_view(view, run) for layer, view in first.items()}))
            alone.difference_update(run.pieces)
    return parts, sorted(alone)
