"""The step layer's worker half: one engine step's loads and saves (docs/architecture.md section 13).

Every adapter (the bundled connector, vLLM's worker, ``KVCacheEngine.store``/``retrieve``)
hands kvlayer one ``StepSpec`` per engine step: plain data that a scheduler side made
(``kvlayer.requests.RequestTracker``) and that may cross a process boundary. ``StepTransfer``
turns it into the step's transfers over the engine's paged caches:

- each ``LoadSpec`` becomes a read of the chunk objects the lookup granted, from the tiers it
  named, into the request's blocks (``kvlayer.pipeline.LoadJob``): layer by layer on the
  engine's loader thread while the forward pass runs (``wait_layer``), or all of it before
  the transfer is returned, as ``layerwise`` says;
- each ``SaveSpec`` becomes a copy of the chunks the step completes out of the cache
  (``kvlayer.pipeline.SaveJob``): right after each layer's attention (``save_layer``), or
  after the forward pass with ``layerwise: off``;
- ``finish`` collects the loads that failed (request -> valid leading tokens, which the engine
  recomputes), drops the saves those failures invalidate, and hands the rest to the tiers.

Keys are computed here, in the worker's namespace (its tensor-parallel rank is part of it),
from the spec's token ids, once per request (``KVCacheEngine``'s key cache). A granted load
whose chunk objects no longer match the lookup's sources is looked up again; a prefix that
is gone by then is a failed load, recomputed. Nothing here raises into the engine after the
constructor: a failure below costs a recompute or a save, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.pipeline import LoadItem, LoadJob, SaveItem, SaveJob, finish_saves, loads_layerwise
from kvlayer.staging import Staging
from kvlayer.tier_manager import TierManager
from kvlayer.transfer import slot_mapping, wait_for_copies
from kvlayer.verify import Verification, VerifyItem
from kvlayer.windows import Found, load_objects, save_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of request ``request_id`` into its blocks ``block_ids`` (those
    covering tokens ``0..end-1``). ``token_ids`` are its tokens from 0 over at least the chunks
    holding ``[0, end)`` (keys are computed from them under ``salt``); ``sources`` the tier of
    each chunk object the lookup found (``Found.sources``)."""

    request_id: str
    salt: str | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    sources: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...] = ()
    """Per group of layers with a block table of its own (vLLM's KV-cache groups under its hybrid
    manager), that table (``block_ids`` is the first's); a negative id is a released block (vLLM's
    null block before a sliding window), never read or written. () for one table."""
    layer_groups: tuple[int, ...] = ()
    """With ``groups``: each model layer's group (its index in ``groups``)."""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the chunks of request ``request_id`` that end after token ``first`` and within
    ``token_ids`` (its tokens from 0), whose KV is in its blocks ``block_ids``. Those starting
    before ``verify_upto`` held a sampled hit the engine recomputed: they are compared with the
    stored objects instead (``kvlayer.verify``)."""

    request_id: str
    salt: str | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    first: int
    verify_upto: int = 0
    groups: tuple[tuple[int, ...], ...] = ()
    """Per group of layers with a block table of its own (vLLM's KV-cache groups under its hybrid
    manager), that table (``block_ids`` is the first's); a negative id is a released block (vLLM's
    null block before a sliding window), never read or written. () for one table."""
    layer_groups: tuple[int, ...] = ()
    """With ``groups``: each model layer's group (its index in ``groups``)."""


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One engine step's loads and saves; what a scheduler side tells its workers."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    async_loads: tuple[LoadSpec, ...] = ()
    """Loads the engine does not wait for (vLLM's ``load_kv_async``): each runs whole in the
    background, outside the step, and the worker reports when its blocks are written."""
    reset: bool = False
    """The engine dropped its cache since the last step: the worker empties its process's own
    memory tiers first (``KVCacheEngine.drop_private_memory``)."""


Keys = Callable[[str, Sequence[int], "str | None"], list[ChunkKey]]
"""(request id, token ids, salt) -> the request's chunk keys over those tokens (cached)."""
Lookup = Callable[[Sequence[ChunkKey], int, int], Found]
"""(keys, start, limit) -> what the tiers hold now (``kvlayer.windows.find_prefix``, uncounted)."""


@dataclass(frozen=True, slots=True)
class StepContext:
    """What ``StepTransfer`` runs with: ``KVCacheEngine``'s internals, handed over by it alone.
    ``loader`` runs layer-by-layer loads; ``streams`` are CUDA's (load, store) or (None, None)."""

    tiers: TierManager
    staging: Staging
    groups: list[tuple[int, int]]
    layout: KVLayout
    device: torch.device
    layerwise: str
    keys: Keys
    lookup: Lookup
    loader: Executor
    streams: tuple[torch.cuda.Stream | None, torch.cuda.Stream | None] = (None, None)
    threads: int = 1
    quantization: str = "none"
    """The serialising tiers' ``storage_quantization`` (what verification allows for)."""


def slots_of(layout: KVLayout, block_ids: Sequence[int], end: int, device: torch.device,
             groups: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """The copy rows of tokens ``0..end-1`` in blocks ``block_ids``: block ids for a layout of
    opaque blocks (``KVLayout.opaque_blocks``), else token slots; int64 on ``device``. With
    ``groups`` (``LoadSpec.groups``), ``[groups, rows]``: each group's rows through its own table."""
    if groups:
        return torch.stack([slots_of(layout, g, end, device) for g in groups])
    if layout.opaque_blocks:
        return torch.tensor(list(block_ids[: -(-end // layout.block_size)]), dtype=torch.long, device=device)
    return slot_mapping(block_ids, layout.block_size, 0, end, device)


def held_from(block_ids: Sequence[int], block_size: int) -> int:
    """The first token of ``block_ids`` after its leading released blocks (negative ids, such as
    those before a sliding window); ``ValueError`` if a released block follows a held one."""
    first = next((i for i, b in enumerate(block_ids) if b >= 0), len(block_ids))
    if any(b < 0 for b in block_ids[first:]):
        raise ValueError(f"a released block after a held one in {list(block_ids)}")
    return first * block_size


@dataclass(slots=True)
class StepCounts:
    """What one step moved: tokens loaded and asked for, chunks staged for saving."""

    loaded_tokens: int = 0
    wanted_tokens: int = 0
    saved_chunks: int = 0
    moved: list[tuple[list[ChunkKey], Sequence[int], int]] = field(default_factory=list)
    """Per save or load: (the request's chunk keys, its token ids, the first token of the chunks moved)."""


class StepTransfer:
    """One step's transfers over ``caches`` (one paged view per layer, ``KVLayout.paged_view``).

    Built by ``KVCacheEngine.start_step``; call ``wait_layer(i)`` before layer i's attention
    reads the cache, ``save_layer(i, cache)`` after it wrote the layer, then ``finish`` once.
    ``slots``: per request id, its copy rows given directly (int64 on the caches' device, as
    ``slots_of`` makes them from block ids), for a whole transfer with nothing computing
    beside it (``KVCacheEngine.store``/``retrieve``): it loads everything before the
    constructor returns and gathers its saves in ``finish``, both on torch's threads.
    """

    def __init__(self, ctx: StepContext, spec: StepSpec, caches: Sequence[torch.Tensor],
                 slots: Mapping[str, torch.Tensor] | None = None) -> None:
        self._ctx = ctx
        self._spec = spec
        self._caches = list(caches)
        self._slots = dict(slots or {})
        self._whole = slots is not None
        self._load: LoadJob | None = None
        self._save: SaveJob | None = None
        self._verify: Verification | None = None
        self._failed: dict[str, int] = {}
        self.counts = StepCounts()
        try:
            self._save = self._prepare_saves()
        except Exception:  # a bug below must cost a save, never the engine
            log.exception("kvlayer: preparing the step's saves failed")
        try:
            self._load = self._start_loads()
        except Exception:
            log.exception("kvlayer: preparing the step's loads failed; they are recomputed")
            self._failed = {ld.request_id: ld.start for ld in spec.loads}

    def _prepare_saves(self) -> SaveJob | None:
        ctx = self._ctx
        items, checks = [], []
        for s in self._spec.saves:
            known = ctx.keys(s.request_id, s.token_ids, s.salt)
            keys = [k for k in known if s.first < k.end <= len(s.token_ids)]
            if not keys:
                continue
            if s.groups:  # a chunk's objects whose blocks a window released cannot be saved
                start = max(self._held(s.groups, keys[-1].end))
                keys = [k for k in keys if k.start >= start]
                if not keys:
                    continue
            rows = self._rows(s.request_id, s, keys[-1].end)
            self.counts.moved.append((known, s.token_ids, keys[0].start))
            # the held chunks of a sampled hit are compared; the saves skip them (held already)
            if sampled := [k for k in keys if k.start < s.verify_upto]:
                checks.append(VerifyItem(s.request_id, tuple(save_keys(ctx.layout, sampled)), rows,
                                         s.layer_groups if s.groups else ()))
            items.append(SaveItem(s.request_id, tuple(save_keys(ctx.layout, keys)), rows,
                                  s.layer_groups if s.groups else ()))
        if checks:
            self._verify = Verification(ctx.tiers, ctx.staging, checks, ctx.quantization)
        if not items:
            return None
        threads = ctx.threads if self._whole else 1
        return SaveJob(ctx.tiers, ctx.staging, items, ctx.streams[1], threads=threads)

    def _start_loads(self) -> LoadJob | None:
        ctx = self._ctx
        items = [self._load_item(ld) for ld in self._spec.loads]
        for ld, item in zip(self._spec.loads, items):
            self.counts.wanted_tokens += ld.end - ld.start
            if item is None:
                self._failed[ld.request_id] = ld.start
        ready = [item for item in items if item is not None]
        if not ready:
            return None
        layerwise = not self._whole and loads_layerwise(ctx.layerwise, ctx.device, ctx.tiers, ready)
        job = LoadJob(ctx.tiers, ctx.staging, ctx.groups, self._caches, ready,
                      ctx.loader if layerwise else None, ctx.streams[0] if layerwise else None,
                      threads=ctx.threads if self._whole else None)
        return job

    def _load_item(self, ld: LoadSpec) -> LoadItem | None:
        """The read of ``ld``'s chunk objects, or None if the tiers no longer hold its prefix."""
        ctx = self._ctx
        keys = [k for k in ctx.keys(ld.request_id, ld.token_ids, ld.salt) if k.start < ld.end]
        objs = load_objects(ctx.layout, keys, ld.start, ld.end)
        sources = ld.sources
        if len(objs) != len(sources):  # granted for another end (or by another lookup): ask again
            found = ctx.lookup(keys, ld.start, ld.end)
            if found.num_tokens < ld.end:
                return None
            objs, sources = list(found.keys), found.sources
        self.counts.moved.append((keys, ld.token_ids, next((k.start for k in keys if k.end > ld.start), ld.start)))
        slots = self._rows(ld.request_id, ld, ld.end)
        # a window's released blocks (vLLM's null block) are never written
        held = self._held(ld.groups or (ld.block_ids,), ld.end) if ld.groups or ctx.layout.windowed else ()
        return LoadItem(ld.request_id, tuple(objs), tuple(sources), slots, ld.start, ld.end,
                        whole=ctx.layout.windowed, layer_groups=ld.layer_groups if ld.groups else (), held_from=held)

    def _rows(self, rid: str, spec: LoadSpec | SaveSpec, end: int) -> torch.Tensor:
        given = self._slots.get(rid)
        if given is not None:
            return given
        return slots_of(self._ctx.layout, spec.block_ids, end, self._ctx.device, spec.groups)

    def _held(self, tables: Sequence[Sequence[int]], end: int) -> tuple[int, ...]:
        """Per block table, the first token of tokens ``0..end-1`` whose block is held (``held_from``)."""
        bs = self._ctx.layout.block_size
        return tuple(held_from(t[: -(-end // bs)], bs) for t in tables)

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` holds what this step loads (or its load failed)."""
        if self._load is not None:
            self._load.wait_layer(layer)

    def save_layer(self, layer: int, cache: torch.Tensor) -> None:
        """Copy layer ``layer`` of the step's completed chunks out of ``cache`` (right after its
        attention wrote it); a no-op with ``layerwise: off`` or for a whole transfer."""
        if self._save is not None and not self._whole and self._ctx.layerwise != "off":
            try:
                self._save.layer(layer, cache)
            except Exception:
                log.exception("kvlayer: copying layer %d of the step's saves failed; they are dropped", layer)
                self._save = None

    def finish(self) -> dict[str, int]:
        """After the forward pass: the failed loads (request -> valid leading tokens), then the
        saves (those a failed load invalidated dropped) handed to the tiers. Call once."""
        load, save, self._load, self._save = self._load, self._save, None, None
        if load is not None:
            self._failed.update(load.failures())
            if self._whole:
                wait_for_copies(self._ctx.device)
        if self._verify is not None:
            self._verify.run(self._caches, self._failed)
            self._verify = None
        loads = self._spec.loads
        loaded = sum(self._failed.get(ld.request_id, ld.end) - ld.start for ld in loads)
        self.counts.loaded_tokens = max(0, loaded)
        self.counts.saved_chunks = len(save) if save is not None else 0
        if save is not None and self._whole:
            try:
                save.gather_all(self._caches)
                wait_for_copies(self._ctx.device)
            except Exception:
                log.exception("kvlayer: copying the chunks to store failed")
                save.finish({rid: 0 for rid in {s.request_id for s in self._spec.saves}})
                return dict(self._failed)
            save.finish(self._failed)
        else:
            finish_saves(save, self._caches, self._failed, self._ctx.layerwise == "off")
        return dict(self._failed)

    def failed_blocks(self) -> set[int]:
        """After ``finish``: the blocks of this step's loads that hold no valid KV."""
        bs = self._ctx.layout.block_size
        out: set[int] = set()
        for ld in self._spec.loads:
            valid = self._failed.get(ld.request_id)
            if valid is not None and valid < ld.end:
                for table in ld.groups or (ld.block_ids,):
                    out.update(b for b in table[valid // bs : -(-ld.end // bs)] if b >= 0)
        return out
