"""An engine's KV-cache groups: layers that share a block table of their own (docs/architecture.md section 13).

An engine serving a hybrid model may keep one block table per kind of attention (vLLM's hybrid KV
cache manager: one KV-cache group for the full-attention layers, one per sliding window), so a
request holds one block-id list per group. ``KVCacheGroups`` says which group each layer is in
and each layer's window; the step layer takes it as is (``RequestTracker``'s ``groups``,
``LoadSpec.groups`` and ``layer_groups``, ``KVLayout.layer_windows``). These are the engine's
groups, not kvlayer's own window groups (``KVLayout.window_groups``, how chunks are stored).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """An engine's KV-cache groups per model layer (layers in model order): ``layer_groups[i]``
    the group of layer i, ``windows[i]`` its sliding window (None: full attention)."""

    layer_groups: tuple[int, ...]
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.layer_groups) != len(self.windows):
            raise ValueError(f"{len(self.layer_groups)} layer groups for {len(self.windows)} layer windows")

    @property
    def num_groups(self) -> int:
        return len(set(self.layer_groups))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """``KVLayout.layer_windows``: the windows, or () when no layer slides."""
        return self.windows if any(w is not None for w in self.windows) else ()

    @property
    def grouped(self) -> tuple[int, ...]:
        """``LoadSpec.layer_groups`` (and the tracker's): the layer groups with more than one
        group, else () (one block table, as without the hybrid manager)."""
        return self.layer_groups if self.num_groups > 1 else ()

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window (None: full attention), in group order."""
        out: list[int | None] = [None] * (max(self.layer_groups, default=-1) + 1)
        for g, w in zip(self.layer_groups, self.windows):
            out[g] = w
        return tuple(out)


def released_before(windows: Sequence[int | None], computed: int) -> list[int]:
    """Per group with window ``windows[g]``, the token before whose blocks the engine releases a
    request's blocks once ``computed`` tokens are computed (vLLM's ``SlidingWindowManager``'s
    skipped tokens, without the extra tokens speculative decoding keeps: never fewer than vLLM's)."""
    return [0 if w is None else max(0, computed - w + 1) for w in windows]
