"""Layer-by-layer transfers between kvlayer and a paged KV cache (docs/architecture.md section 6).

``LoadJob`` brings one step's matched prefixes into the cache. It reads every request's
chunks from the tiers the lookup found them in, all at once (``kvlayer.read_plan``: memory
tiers' chunks whole, lower tiers' layer group by layer group), copies each layer into the
cache as soon as it has arrived for every chunk, and marks it ready; the forward pass calls ``wait_layer(i)`` just
before layer i's attention, so it computes layer i while later layers are still being read
and copied. Run on an executor thread (layerwise) or right away (baseline). A chunk that fails
verification after its first layers were used ends the request's valid prefix (``failures``):
the engine then discards the step's work for that request and recomputes it.

``SaveJob`` takes one step's newly completed chunks out of the cache: staging chunks are
allocated when the step starts (for the chunks after the prefix the tiers already hold),
``layer(i, cache)`` copies layer i into them right after that layer's attention, and ``finish``
hands them to the tiers (the lower tiers are written in the background), so the step waits only
for the copies.

On CUDA both jobs copy on their own streams and order themselves against the engine's stream
with events (no device-wide synchronisation); on the CPU they use the torch copies. A job owns
the references to the chunks it holds and releases them once its copies are done.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch

from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.metrics import Metrics
from kvlayer.read_plan import ChunkReads, LayerGroups, ReadPlan
from kvlayer.staging import Staging
from kvlayer.tier_manager import TierManager
from kvlayer.transfer import CopyPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Bring tokens ``[start, end)`` of one request into the cache.

    ``keys``: the request's chunk keys from token 0 (at least those overlapping ``[start, end)``);
    ``sources``: the tier of each of its leading found chunks (``LookupResult.sources``; the
    chunks after them are not read); ``slots``: int64 on the caches' device, the cache slot of
    each token ``0..end-1`` (for opaque blocks, ``KVLayout.copy_unit``, the block id of each
    block, with ``start`` and ``end`` on block boundaries). ``whole``: the keys are a window-aware
    selection of chunk objects (``kvlayer.windows.Found``), valid only together, so one that
    fails leaves the request at ``start``. ``layer_groups`` (an engine with one block table per
    group of layers, vLLM's KV-cache groups): each model layer's group, ``slots`` then
    ``[groups, ...]``, one row of copy rows per group; () for one table. ``held_from``: per group
    (or the one table), the first token whose block is held: the rows before it are released
    blocks (vLLM's null block before a sliding window), never written; () for all held.
    """

    request_id: str
    keys: tuple[ChunkKey, ...]
    sources: tuple[int, ...]
    slots: torch.Tensor
    start: int
    end: int
    whole: bool = False
    layer_groups: tuple[int, ...] = ()
    held_from: tuple[int, ...] = ()

    def plan(self) -> ReadPlan:
        """The found chunks holding tokens of ``[start, end)``, in order, with their tiers."""
        wanted = [i for i, k in enumerate(self.keys[: len(self.sources)]) if k.end > self.start and k.start < self.end]
        return ReadPlan(tuple(self.keys[i] for i in wanted), tuple(self.sources[i] for i in wanted))


@dataclass(frozen=True, slots=True)
class SaveItem:
    """Store the chunks ``keys`` of one request; ``slots`` (int64, the caches' device) holds the
    cache slot of each token ``0..keys[-1].end-1`` (or block id of each block, as for ``LoadItem``;
    per group with ``layer_groups``, as there)."""

    request_id: str
    keys: tuple[ChunkKey, ...]
    slots: torch.Tensor
    layer_groups: tuple[int, ...] = ()


class LoadJob:
    """One step's loads; see the module docstring.

    Reads go through ``tiers`` into ``staging`` chunks, layer ``groups`` at a time (see
    ``kvlayer.read_plan``) where a layer is used as soon as it is in (beside compute, or on
    CUDA); a whole load on the CPU reads each chunk whole. ``executor`` None: everything is
    loaded before the constructor returns. ``stream``: the CUDA stream to copy on (None off
    CUDA). ``threads``: the CPU threads a load with no ``executor`` may scatter on (default:
    torch's); beside compute it is one. Call ``wait_layer`` for each layer before using it and
    ``failures`` once after the forward pass.
    """

    def __init__(self, tiers: TierManager, staging: Staging, groups: LayerGroups, caches: Sequence[torch.Tensor],
                 items: Sequence[LoadItem], executor: Executor | None = None,
                 stream: torch.cuda.Stream | None = None, threads: int | None = None) -> None:
        self._tiers = tiers
        self._staging = staging
        self._groups = groups
        self._caches = list(caches)
        self._items = list(items)
        self._stream = stream
        self._threads = threads
        self._valid = {item.request_id: item.start for item in self._items}
        self._ready = [threading.Event() for _ in self._caches]
        self._events = [torch.cuda.Event() for _ in self._caches] if stream is not None else []
        self._start_event = _record(stream)
        self._future: Future[None] | None = None
        self._beside_compute = executor is not None
        if executor is None:
            self._run()
        else:
            self._future = executor.submit(self._run)

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` holds every chunk this job could load (or the job failed)."""
        self._ready[layer].wait()
        if self._events:
            torch.cuda.current_stream(self._caches[layer].device).wait_event(self._events[layer])

    def failures(self) -> dict[str, int]:
        """Waits for the job; then, per request not fully loaded, how many leading tokens it has."""
        if self._future is not None:
            self._future.result()
        return {it.request_id: self._valid[it.request_id] for it in self._items
                if self._valid[it.request_id] < it.end}

    # --- the job --------------------------------------------------------------------------
    def _run(self) -> None:
        reads: ChunkReads | None = None
        try:
            plans = [item.plan() for item in self._items]
            # a whole load on the CPU reads each file whole: per layer group, the hand-offs to the
            # read threads cost more than the scatter gains by starting early (docs/benchmarks.md)
            groups = self._groups if self._beside_compute or self._events else [(0, len(self._caches))]
            reads = ChunkReads.open(self._tiers, plans, self._staging, groups)
            # a load on the caller's thread has the CPU to itself: its scatter may use torch's threads
            pieces = [piece for item, plan, chunks in zip(self._items, plans, reads.objs, strict=True)
                      for piece in _pieces(self._staging.layout, item, plan.keys, chunks)]
            copies = CopyPlan([(rows, slots) for rows, slots, _ in pieces],
                              threads=1 if self._beside_compute else self._threads or torch.get_num_threads(),
                              layers=[layers for _, _, layers in pieces])
            with _on(self._stream, self._start_event):
                if self._beside_compute or self._events:  # each layer announced as soon as it is in
                    for layer, cache in enumerate(self._caches):
                        reads.wait_layer(layer)
                        copies.scatter_layer(layer, cache)
                        if self._events:
                            self._events[layer].record(self._stream)
                        self._ready[layer].set()
                else:  # nobody waits before the job returns: one hand-off to the copy threads
                    copies.scatter(self._caches, before=reads.wait_layer)
            counts = reads.finish()
            for item, plan, n in zip(self._items, plans, counts, strict=True):
                if item.whole and n < len(plan.keys):
                    n = 0
                self._valid[item.request_id] = min(plan.keys[n - 1].end, item.end) if n else item.start
                _count_loaded(self._tiers.metrics, self._staging.layout, plan.keys[:n], item.start, item.end)
        except Exception:  # a bug below must cost a recompute, never the engine
            log.exception("kvlayer: loading %d requests failed; they are recomputed", len(self._items))
        finally:
            for ready in self._ready:
                ready.set()
            if self._stream is not None:
                self._stream.synchronize()  # the copies read the chunks released below
            if reads is not None:
                reads.release()


class SaveJob:
    """One step's saves; see the module docstring. Stages the chunks at construction; call
    ``layer`` for every layer (in any order) or ``gather_all`` once, then ``finish`` exactly once.

    Each item's chunks after the leading ones the tiers hold already (one presence check for
    all items) get memory of the top memory tier (``TierManager.reserve``) or else a ``staging``
    chunk, up to the first that gets neither; ``finish`` hands them to ``tiers`` (the top
    memory tier now, adopting its own memory without a copy; the others in the background).
    ``threads``: how many threads ``gather_all`` may share the chunks among on the CPU (the
    caller's included; ``CopyPlan``): more than 1 only where nothing computes meanwhile. ``layer``
    always copies on the caller's thread alone, as it runs beside the forward pass.
    """

    def __init__(self, tiers: TierManager, staging: Staging, items: Sequence[SaveItem],
                 stream: torch.cuda.Stream | None = None, threads: int = 1) -> None:
        self._tiers = tiers
        self._stream = stream
        self._chunks: list[tuple[str, ChunkKey, MemoryObj, SaveItem]] = []
        held = tiers.lookup_many([item.keys for item in items], record=False) if items else []
        wanted = [(item, key) for item, found in zip(items, held) for key in item.keys[found.num_chunks :]]
        # gathered straight into the top memory tier where it can (its store then copies nothing)
        reserved = iter(tiers.reserve([key for _, key in wanted]) if wanted else [])
        stopped: set[str] = set()
        for item, key in wanted:
            obj = next(reserved)
            if item.request_id in stopped or (obj is None and (obj := staging.allocate(key)) is None):
                stopped.add(item.request_id)  # an item's chunks are saved up to its first unstaged one
                if obj is not None:
                    obj.release()
                continue
            self._chunks.append((item.request_id, key, obj, item))
        layout = staging.layout
        pieces = [piece for _, key, obj, item in self._chunks
                  for piece in group_pieces(layout, layout.chunk_view(obj.tensor), key, key.start, key.end,
                                            item.slots, item.layer_groups, ())]
        self._copies = CopyPlan([(rows, slots) for rows, slots, _ in pieces], threads=threads,
                                layers=[layers for _, _, layers in pieces])

    def __len__(self) -> int:
        return len(self._chunks)

    def layer(self, layer: int, cache: torch.Tensor) -> None:
        """Copy layer ``layer`` of every staged chunk out of that layer's ``cache``."""
        if not self._chunks:
            return
        with _on(self._stream, _record(self._stream)):
            self._copies.gather_layer(layer, cache)

    def gather_all(self, caches: Sequence[torch.Tensor]) -> None:
        """Copy every layer of every staged chunk out of ``caches`` (one per layer) in one call:
        on the CPU shared among the job's ``threads``, each running through all layers."""
        if not self._chunks:
            return
        with _on(self._stream, _record(self._stream)):
            self._copies.gather(caches)

    def finish(self, failed: dict[str, int] | None = None) -> None:
        """Wait for the copies, then store the chunks, except those of a request in ``failed``
        ending after its valid tokens (their KV was never loaded); releases every chunk."""
        failed = failed or {}
        chunks, self._chunks = self._chunks, []
        try:
            if self._stream is not None:
                self._stream.synchronize()
        except BaseException:
            _release([obj for _, _, obj, _ in chunks])
            raise
        keys, objs = [], []
        for rid, key, obj, _ in chunks:
            if key.end > failed.get(rid, key.end):
                obj.release()
                continue
            keys.append(key)
            objs.append(obj)
        try:
            if keys:
                self._tiers.store(keys, objs)  # one trip to the tiers for the whole step
        finally:
            _release(objs)


def finish_saves(save: SaveJob | None, caches: Sequence[torch.Tensor], failed: dict[str, int],
                 copy_all: bool) -> None:
    """End a step's saves after its forward pass: copy every layer of ``caches`` out first when
    ``copy_all`` (``layerwise: off``), then ``save.finish(failed)``. Never raises: a failure here
    costs the step's saves (logged), never the engine."""
    if save is None:
        return
    try:
        if copy_all:
            for layer, cache in enumerate(caches):
                save.layer(layer, cache)
        save.finish(failed)
    except Exception:
        log.exception("kvlayer: saving the step's chunks failed")


def loads_layerwise(mode: str, device: torch.device, tiers: TierManager, items: Sequence[LoadItem]) -> bool:
    """Whether a step's loads go layer by layer (``kvlayer.config.LAYERWISE``, ``mode``): ``on``;
    under ``auto``, on CUDA, or when a chunk comes from a tier not in memory (NVMe, Redis)."""
    if mode != "auto":
        return mode == "on"
    if device.type == "cuda":
        return True
    guarded = tiers.guarded
    return any(not guarded[s].in_memory for item in items for s in item.sources)


Piece = tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]
"""A ``CopyPlan`` piece: chunk rows, their copy rows, and the model layers the rows hold (() all)."""


def _pieces(layout: KVLayout, item: LoadItem, keys: Sequence[ChunkKey], objs: list[MemoryObj]) -> list[Piece]:
    """Each chunk's rows of tokens ``[item.start, item.end)`` (``layout.chunk_view``) and their slots."""
    out = []
    unit = layout.copy_unit
    for key, obj in zip(keys, objs):
        lo, hi = max(key.start, item.start), min(key.end, item.end)
        rows = layout.chunk_view(obj.tensor)
        if (lo, hi) != (key.start, key.end):
            rows = rows[:, :, (lo - key.start) // unit : -(-(hi - key.start) // unit)]
        out += group_pieces(layout, rows, key, lo, hi, item.slots, item.layer_groups, item.held_from)
    return out


def group_pieces(layout: KVLayout, rows: torch.Tensor, key: ChunkKey, lo: int, hi: int, slots: torch.Tensor,
                 layer_groups: Sequence[int], held_from: Sequence[int]) -> list[Piece]:
    """The pieces copying ``rows`` (chunk ``key``'s rows of tokens ``[lo, hi)``) through ``slots``:
    one for one block table; with ``layer_groups``, one per run of the chunk's layers in the same
    group, through that group's copy rows. Rows before a group's ``held_from`` are left out."""
    unit = layout.copy_unit
    if not layer_groups:
        first = max(lo, held_from[0]) if held_from else lo
        if first >= hi:
            return []
        if first == lo:
            return [(rows, slots[lo // unit : -(-hi // unit)], key.layers)]
        return [(rows[:, :, (first - lo) // unit :], slots[first // unit : -(-hi // unit)], key.layers)]
    layers = key.layers or tuple(range(layout.num_layers))
    out: list[Piece] = []
    a = 0
    while a < len(layers):
        g = layer_groups[layers[a]]
        b = a + 1
        while b < len(layers) and layer_groups[layers[b]] == g:
            b += 1
        first = max(lo, held_from[g]) if held_from else lo
        if first < hi:
            out.append((rows[a:b, :, (first - lo) // unit :], slots[g, first // unit : -(-hi // unit)], layers[a:b]))
        a = b
    return out


def _count_loaded(metrics: Metrics, layout: KVLayout, keys: Sequence[ChunkKey], start: int, end: int) -> None:
    """Credit each layer group with the tokens of ``[start, end)`` that ``keys`` (verified chunk
    objects) loaded for it (``kv_stats()["loaded_tokens"]``)."""
    names = {g.layers if len(g.layers) < layout.num_layers else (): g.name for g in layout.window_groups}
    for key in keys:
        tokens = min(key.end, end) - max(key.start, start)
        if tokens > 0:
            metrics.add_loaded(names.get(key.layers, "other"), tokens)


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event on the current stream (what the engine queued so far), on CUDA only."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(stream.device))
    return event


def _on(stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> contextlib.AbstractContextManager[object]:
    """Run the block's copies on ``stream``, after ``after``; off CUDA, where they are."""
    if stream is None:
        return contextlib.nullcontext()
    if after is not None:
        stream.wait_event(after)
    return torch.cuda.stream(stream)
