"""vLLM's KV-cache groups as kvlayer's connector sees them (docs/vllm.md, "Hybrid models").

With its hybrid KV cache manager on (the connector implements ``SupportsHMA``), vLLM keeps one
KV-cache group per attention kind of a hybrid model (full attention, a sliding window), each
with a block table of its own: the connector gets one block-id list per group. ``KVCacheGroups``
says which group each layer is in and each layer's window (for ``KVLayout.layer_windows``);
``block_tables`` turns vLLM's per-group lists into the step layer's tables (``LoadSpec.groups``),
with vLLM's null block (id 0, the blocks a sliding window skips) as a released block (-1).
Imports vLLM only inside ``kv_cache_groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0
"""vLLM's null block (``BlockPool.null_block``): never a request's own, it stands for the blocks
a sliding window skips. kvlayer never reads or writes it."""
RELEASED = -1
"""The step layer's id for a released block (``kvlayer.step.held_from``)."""


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """vLLM's KV-cache groups per model layer (layers in model order): ``layer_groups[i]`` the
    group of layer i, ``windows[i]`` its sliding window (None: full attention)."""

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
    """Per group with window ``windows[g]``, the token before whose blocks vLLM releases a
    request's blocks once ``computed`` tokens are computed (``SlidingWindowManager``'s skipped
    tokens, without the extra tokens speculative decoding keeps: never fewer than vLLM's)."""
    return [0 if w is None else max(0, computed - w + 1) for w in windows]


def kv_cache_groups(kv_cache_config: Any, block_size: int) -> KVCacheGroups | None:
    """The groups of vLLM's ``KVCacheConfig`` (None without one). ``ValueError`` for a group kvlayer
    cannot store (neither full attention nor a sliding window, such as Mamba's state) or a
    block size other than ``block_size``."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return None
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    where: dict[str, tuple[int, int | None]] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec):
            window = None
        else:
            raise ValueError(f"kvlayer's vLLM connector stores attention KV only, not {type(spec).__name__} "
                             f"(KV-cache group {g})")
        if int(spec.block_size) != block_size:
            raise ValueError(f"KV-cache group {g} has block size {spec.block_size}, not {block_size}")
        where.update((name, (g, window)) for name in group.layer_names)
    names = sorted(where, key=extract_layer_index)
    return KVCacheGroups(tuple(where[n][0] for n in names), tuple(where[n][1] for n in names))


def block_tables(block_ids: Sequence[int], groups: Sequence[Sequence[int]] = ()) -> tuple[list[int], list[list[int]]]:
    """The step layer's block tables from vLLM's: ``(first table, every group's table)``, the
    latter [] with one group (``block_ids`` is then the table). ``groups``: vLLM's per-group lists
    (``block_ids`` their first). vLLM's null block becomes ``RELEASED``."""
    if len(groups) > 1:
        tables = [[RELEASED if b == NULL_BLOCK else b for b in g] for g in groups]
        return tables[0], tables
    return [RELEASED if b == NULL_BLOCK else b for b in block_ids], []
