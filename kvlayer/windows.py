"""Window-aware tiers: what of a prefix a model with sliding windows needs (docs/architecture.md section 12).

A layer with window W never reads a key more than W - 1 positions behind its query. A hit on a
prefix of ``P`` tokens, the engine computing from position ``P`` on, therefore needs a window
layer's KV only for positions ``j > P - W``, and a full-attention layer's for every position.
``KVLayout.window_groups`` groups the layers by their window:

- **one group** (every layer full, or every layer the same window): a chunk holds every layer,
  under its chained key, as for any model;
- **several groups** (a hybrid such as Qwen2 with ``max_window_layers``, or Gemma's 5:1): each
  chunk is stored as one object per group (``group_key``), so a load reads only the groups and
  tokens it needs.

``find_prefix`` answers a lookup: the longest prefix whose full groups' chunks are all held and
whose window groups' chunks are held over the window before its end, with the tier of each
chunk object to read. Only that window is asked for, so a window-only model's stored prefix is
served from its last chunks alone, even after its first ones were evicted. ``save_keys`` lists
every group's object of each chunk (saves store them all: any chunk may end a later prefix).

Tokens of a window-aware load before ``Found.all_layers_from`` hold the full layers' KV only (or
none, for a window-only model): the engine must not offer their blocks to other requests, and
the connector must not save them again (``KVConnectorBase.get_kv_complete_from``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlayer.keys import ChunkKey, group_key
from kvlayer.layout import KVLayout, WindowGroup
from kvlayer.tier_manager import TierManager

MAX_ROUNDS = 8
"""Lookups ``find_prefix`` makes for the window groups at most before it answers a miss: each
round that fails moves the candidate end before the first chunk found missing."""


@dataclass(frozen=True, slots=True)
class Found:
    """A usable prefix: tokens ``[start, num_tokens)`` can be loaded by reading ``keys[i]`` (chunk
    objects, chunk by chunk, each group's after the full group's) from tier ``sources[i]``.
    ``all_layers_from``: the first position from which every layer's KV is loaded (``start`` when
    the load holds every layer everywhere)."""

    num_tokens: int
    keys: tuple[ChunkKey, ...] = ()
    sources: tuple[int, ...] = ()
    all_layers_from: int = 0

    @property
    def num_chunks(self) -> int:
        return len(self.keys)


def save_keys(layout: KVLayout, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
    """Every group's object of each of ``keys`` (chunks of all layers), chunk by chunk: ``keys``
    itself for a layout of one group."""
    groups = layout.window_groups
    if len(groups) == 1:
        return list(keys)
    return [group_key(k, g, layout.num_layers) for k in keys for g in groups]


def window_start(group: WindowGroup, start: int, end: int) -> int:
    """The first position of ``[start, end)`` a query at ``end`` (and after) can read in ``group``."""
    return start if group.window is None else max(start, end - group.window + 1)


def find_prefix(tiers: TierManager, layout: KVLayout, keys: Sequence[ChunkKey], start: int, limit: int,
                record: bool = True) -> Found:
    """The longest usable prefix of chunk ``keys`` (from token 0, chained) for a request that
    holds its first ``start`` tokens already and may load up to ``limit`` tokens (its prompt's
    length minus one); no data moves. A plain prefix lookup for a layout without windows."""
    keys = [k for k in keys if k.start < limit]
    skip = _first_chunk(keys, start)  # chunks the request holds already: never asked (a chained key
    # names its whole prefix, so a later chunk's hit stands alone), so their eviction loses nothing
    if not layout.windowed:
        got = tiers.lookup(keys[skip:], record)
        n = skip + got.num_chunks
        end = min(keys[n - 1].end, limit) if got.num_chunks else 0
        if end <= start:
            return Found(start)
        # the skipped chunks are not read (a load starts at ``start``); they take the first source
        return Found(end, tuple(keys[:n]), (got.sources[0],) * skip + got.sources, start)
    groups = layout.window_groups
    full = [g for g in groups if g.window is None]
    windows = [g for g in groups if g.window is not None]
    n, full_sources = len(keys), ()
    if full:
        got = tiers.lookup([group_key(k, full[0], layout.num_layers) for k in keys[skip:]], record)
        n, full_sources = skip + got.num_chunks, got.sources
        if not got.num_chunks:
            return Found(start)
        record = False
    for _ in range(MAX_ROUNDS):
        end = min(keys[n - 1].end, limit) if n else 0
        if end <= start:
            return Found(start)
        firsts = [_first_chunk(keys, window_start(g, start, end)) for g in windows]
        asked = [[group_key(k, g, layout.num_layers) for k in keys[a:n]] for g, a in zip(windows, firsts)]
        answers = tiers.lookup_many(asked, record)
        record = False
        missing = [a + r.num_chunks for a, r, ks in zip(firsts, answers, asked) if r.num_chunks < len(ks)]
        if missing:
            n = min(missing)  # every shorter candidate's window still holds that chunk, up to it
            continue
        return _found(layout, keys[:n], start, end, full, (skip, full_sources), windows, firsts, answers)
    return Found(start)


def _first_chunk(keys: Sequence[ChunkKey], position: int) -> int:
    """The index of the chunk holding ``position`` (keys are consecutive from token 0)."""
    return next((i for i, k in enumerate(keys) if k.end > position), len(keys))


def load_objects(layout: KVLayout, keys: Sequence[ChunkKey], start: int, end: int) -> list[ChunkKey]:
    """The chunk objects a load of tokens ``[start, end)`` reads, given the request's chunk
    ``keys`` from token 0: without windows, the chunks from token 0 up to ``end`` (a
    ``LoadItem`` skips those before ``start``); with windows, chunk by chunk the full group's
    object of each chunk after ``start`` and each window group's object of the chunks a query
    at ``end`` can still read. ``Found.keys`` for the same ``[start, end)``, so a worker that
    computed its own keys knows what a lookup's ``sources`` name."""
    keys = [k for k in keys if k.start < end]
    if not layout.windowed:
        return keys
    groups = layout.window_groups
    full = [g for g in groups if g.window is None]
    windows = [g for g in groups if g.window is not None]
    firsts = [_first_chunk(keys, window_start(g, start, end)) for g in windows]
    objs: list[ChunkKey] = []
    for i, key in enumerate(keys):
        if key.end <= start:
            continue
        if full:
            objs.append(group_key(key, full[0], layout.num_layers))
        objs.extend(group_key(key, g, layout.num_layers) for g, a in zip(windows, firsts) if i >= a)
    return objs


def _found(layout: KVLayout, keys: Sequence[ChunkKey], start: int, end: int, full: list[WindowGroup],
           full_sources: tuple[int, Sequence[int]], windows: list[WindowGroup], firsts: list[int],
           answers: list) -> Found:
    """The chunk objects to read, chunk by chunk, for the prefix ``keys`` (``[start, end)`` loaded);
    ``full_sources``: the first chunk the full group's lookup asked for, and its answer's sources."""
    where: dict[bytes, int] = {}
    if full:
        skip, sources = full_sources
        where.update((group_key(k, full[0], layout.num_layers).digest, s) for k, s in zip(keys[skip:], sources))
    for g, a, r in zip(windows, firsts, answers):
        where.update((group_key(k, g, layout.num_layers).digest, s) for k, s in zip(keys[a:], r.sources))
    objs = load_objects(layout, keys, start, end)
    complete = max([keys[a].start if a < len(keys) else end for a in firsts] + [start])
    return Found(end, tuple(objs), tuple(where[o.digest] for o in objs), complete)
