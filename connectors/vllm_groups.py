"""vLLM's KV-cache groups as kvlayer's connector sees them (docs/vllm.md, "Hybrid models").

With its hybrid KV cache manager on (the connector implements ``SupportsHMA``), vLLM keeps one
KV-cache group per attention kind of a hybrid model (full attention, a sliding window), each
with a block table of its own: the connector gets one block-id list per group.
``kv_cache_groups`` reads them from vLLM's ``KVCacheConfig`` as the step layer's
``kvlayer.cache_groups.KVCacheGroups``; ``block_tables`` turns vLLM's per-group lists into the
step layer's tables (``LoadSpec.groups``), with vLLM's null block (id 0, the blocks a sliding
window skips) as a released block (-1). Imports vLLM only inside ``kv_cache_groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlayer.cache_groups import KVCacheGroups

NULL_BLOCK = 0
"""vLLM's null block (``BlockPool.null_block``): never a request's own, it stands for the blocks
a sliding window skips. kvlayer never reads or writes it."""
RELEASED = -1
"""The step layer's id for a released block (``kvlayer.step.held_from``)."""


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
