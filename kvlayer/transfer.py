"""Copies between the engine's paged KV cache and kvlayer chunks: gathers and scatters.

A paged cache is one tensor per layer ``[planes, num_blocks, block_size, kv_heads, head_dim]`` (planes
2: keys and values; 1: MLA's latent), the engine's own or a view of it (``KVLayout.paged_view``: for
opaque blocks, one row per block); ``slots`` (int64, on the caches' device) names the cache slot
(or block) of each chunk row. Each call
runs the Triton kernels of ``kvlayer.kernels.copy_ops`` when ``use_triton`` says so (default:
the caches are on CUDA and triton is installed), else the torch code below, which runs on any
device. A chunk in host memory while the caches are on the GPU goes through a device staging
buffer and one bulk ``copy_(non_blocking=True)``: from pinned memory that copy is asynchronous
on the current stream, so the caller must synchronise before reading a gathered host chunk
or reusing a scattered one.

``CopyPlan`` runs these copies for several chunks (or token slices of chunks) one layer at a
time, as kvlayer's loads and saves do: it makes the views each copy needs once, when it is
built, rather than once per layer and chunk (a call's own views and checks cost as much as the
copy of a 16-token layer), so a caller with many chunks builds one plan per step; ``gather`` and
``scatter`` are one-chunk plans.

On the CPU, ``index_copy_`` moves one element per step, so a scatter whose token rows allow it
moves them as 16-byte elements (``_wide``): a bit-exact move, about 2.8x faster than float32
elements while the rows are in cache, about 1.4x for 256 tokens or more of the ``bench`` layout
from memory. Pieces one stride apart in one arena move as one op per layer (``kvlayer.copy_runs``).
``index_select`` copies each row as one piece already, so gathers use it as is, but on one
thread: a whole ``CopyPlan.gather`` may share its pieces among threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import cast

import torch

from kvlayer.copy_runs import Run, RunPart, find_runs, run_parts
from kvlayer.kernels import triton_available


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots of token positions ``[start, end)`` of a sequence with block table ``block_ids``."""
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    two, blocks, bs, heads, dim = cache.shape
    return cache.view(two, blocks * bs, heads, dim)


_WIDE = torch.complex128
"""The widest torch dtype: 16 bytes, copied by plain moves (no arithmetic touches the bits)."""


_GRAIN = 32768
"""torch's parallel grain (``at::internal::GRAIN_SIZE``): an op over more elements runs on its threads."""

_WIDE_MIN_BYTES = 256 << 10
"""The smallest single ``scatter_layer`` worth its 16-byte views: below it (128 tokens of 1 KiB rows)
their cost exceeds what they save. A ``CopyPlan`` makes them once, so it always uses them."""


def _wide(rows: torch.Tensor, element: torch.dtype = _WIDE) -> torch.Tensor | None:
    """``rows`` ``[..., kv_heads, head_dim]`` with each token row seen as ``row_bytes // size``
    elements of ``element`` (16 bytes by default, or 8), ``[..., row_bytes // size]``; None where a
    row is not contiguous, a multiple of ``size`` bytes and ``size``-aligned, or another stride is
    not a multiple of ``size`` bytes."""
    size = element.itemsize
    if rows.data_ptr() % size or rows.stride(-1) != 1 or (rows.shape[-2] != 1 and rows.stride(-2) != rows.shape[-1]):
        return None
    try:  # with the rows contiguous, flatten is a view; view(dtype) refuses the other cases itself
        return rows.flatten(-2).view(element)
    except RuntimeError:
        return None


def _element(layer_bytes: int, threads: int) -> torch.dtype:
    """The element a CPU plan scatters a piece's layer of ``layer_bytes`` as: 8 bytes where that
    lets torch split the copy among its own threads and 16-byte elements would not (a plan that
    may use ``threads`` > 1), else 16 bytes. torch's own threads are the OpenMP workers that spin
    after the engine's last parallel op: work handed to them does not compete with them, as the
    plan's copy threads do (measured in docs/benchmarks.md, "kvlayer against LMCache")."""
    if threads > 1 and _GRAIN * 8 < layer_bytes <= _GRAIN * 16:
        return torch.float64
    return _WIDE


def _use_triton(use_triton: bool | None, cache: torch.Tensor) -> bool:
    """The explicit choice, else whether ``cache`` is on CUDA with triton installed."""
    if use_triton is not None:
        return use_triton
    return cache.is_cuda and triton_available()


def _direct(chunk: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernels can address ``chunk`` in place (same device, contiguous token rows)."""
    from kvlayer.kernels.copy_ops import rows_contiguous

    return chunk.device == cache.device and rows_contiguous(chunk)


def gather_layer(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                 use_triton: bool | None = None) -> None:
    """``out[:, i] = cache slot slots[i]`` for one layer; ``out`` is ``[planes, n, kv_heads, head_dim]``."""
    if _use_triton(use_triton, cache):
        from kvlayer.kernels import copy_ops

        _gather_staged(copy_ops.gather_layer, cache, cache, slots, out)
        return
    flat = _flat(cache)
    if out.device == flat.device and out.is_contiguous():
        torch.index_select(flat, 1, slots, out=out)
    else:
        out.copy_(flat.index_select(1, slots), non_blocking=True)


def scatter_layer(chunk_layer: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                  use_triton: bool | None = None) -> None:
    """Write ``chunk_layer`` ``[planes, n, kv_heads, head_dim]`` into one layer's cache at ``slots``."""
    src = chunk_layer if chunk_layer.device == cache.device else chunk_layer.to(cache.device, non_blocking=True)
    if _use_triton(use_triton, cache):
        from kvlayer.kernels import copy_ops

        copy_ops.scatter_layer(src if _direct(src, cache) else src.contiguous(), cache, slots)
        return
    flat = _flat(cache)
    big = flat.is_cpu and src.numel() * src.element_size() >= _WIDE_MIN_BYTES
    wide_cache, wide_src = (_wide(flat), _wide(src)) if big else (None, None)
    if wide_cache is not None and wide_src is not None:
        wide_cache.index_copy_(1, slots, wide_src)
    else:
        flat.index_copy_(1, slots, src)


def gather(caches: Sequence[torch.Tensor], slots: torch.Tensor, out: torch.Tensor,
           use_triton: bool | None = None) -> None:
    """All layers: ``out`` ``[num_layers, planes, n, kv_heads, head_dim]`` from ``caches`` at ``slots``."""
    if caches and _use_triton(use_triton, caches[0]):
        from kvlayer.kernels import copy_ops

        _gather_staged(copy_ops.gather, caches, caches[0], slots, out)
        return
    CopyPlan([(out, slots)], use_triton=False).gather(caches)


def scatter(chunk: torch.Tensor, caches: Sequence[torch.Tensor], slots: torch.Tensor,
            use_triton: bool | None = None) -> None:
    """All layers: write ``chunk`` ``[num_layers, planes, n, kv_heads, head_dim]`` into ``caches`` at ``slots``."""
    if caches and _use_triton(use_triton, caches[0]):
        from kvlayer.kernels import copy_ops

        src = chunk.to(caches[0].device, non_blocking=True)
        copy_ops.scatter(src if _direct(src, caches[0]) else src.contiguous(), caches, slots)
        return
    CopyPlan([(chunk, slots)], use_triton=False).scatter(caches)


class CopyPlan:
    """Gathers or scatters of several chunks through one layer's cache at a time.

    ``pieces``: ``(chunk, slots)`` pairs, ``chunk`` ``[num_layers, planes, n, kv_heads, head_dim]`` (a
    chunk or a token slice of one, host or device memory) and ``slots`` the cache slot of each
    of its ``n`` tokens (int64, on the caches' device). ``layers[i]``, if given and not empty,
    names the model layers piece i holds, in order (a window group's chunk, ``ChunkKey.layers``):
    a call for another layer leaves the piece alone. The plan holds views of the chunks, no
    copies: their owner keeps them alive while the plan is used, and ``wait_for_copies`` applies
    as for the functions above. ``use_triton`` as there. ``threads``: how many threads a CPU
    ``scatter`` or ``gather`` (not ``*_layer``) may spread its pieces over, the caller's included
    (see ``_ONE_THREAD_BYTES``, ``_gather_helpers``); give more than 1 only where no other CPU
    work runs meanwhile. Use a plan from one thread.
    """

    def __init__(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], use_triton: bool | None = None,
                 threads: int = 1, layers: Sequence[Sequence[int]] | None = None) -> None:
        self._threads = threads
        self._chunks = [chunk for chunk, _ in pieces]
        named = layers or [()] * len(pieces)
        self._ids = [tuple(ids) or tuple(range(c.shape[0])) for c, ids in zip(self._chunks, named)]
        self._layers = [dict(zip(ids, torch.unbind(c))) for c, ids in zip(self._chunks, self._ids)]
        self._slots = [slots for _, slots in pieces]
        self._wide: list[dict[int, torch.Tensor] | None] | None = None
        self._use_triton = use_triton

    @cached_property
    def _runs(self) -> list[Run]:
        """Pieces one stride apart in one arena, one op per layer each (``copy_runs``); found on first use."""
        return find_runs(self._chunks, self._slots, self._ids)

    @cached_property
    def _elements(self) -> list[torch.dtype]:
        """The element each piece's rows scatter as: 16 bytes in a run, else as ``_element`` says."""
        return [_WIDE if any(i in run.pieces for run in self._runs) else _element(c.nbytes // max(1, c.shape[0]),
                self._threads) for i, c in enumerate(self._chunks)]

    def scatter_layer(self, layer: int, cache: torch.Tensor) -> None:
        """Write layer ``layer`` of every piece holding it into ``cache``, that layer's cache (this thread only)."""
        if not self._chunks:
            return
        dst = self._wide_cache(cache)
        if dst is None:
            for layers, slots in zip(self._layers, self._slots):
                if layer in layers:
                    scatter_layer(layers[layer], cache, slots, self._use_triton)
        else:
            self._scatter_wide(layer, cache, dst, range(len(self._slots)))

    def _wide_cache(self, cache: torch.Tensor) -> dict[torch.dtype, torch.Tensor] | None:
        """``cache``'s slots as the elements the pieces' wide views use (``_element``), by element
        dtype, for the CPU scatter; None off the CPU, with Triton, or where its rows allow no such view."""
        if not cache.is_cpu or _use_triton(self._use_triton, cache):
            return None
        self._wide_layers()
        flat = _flat(cache)
        views = {element: _wide(flat, element) for element in set(self._elements)}
        return None if any(v is None for v in views.values()) else cast(dict[torch.dtype, torch.Tensor], views)

    def _scatter_wide(self, layer: int, cache: torch.Tensor, dst: dict[torch.dtype, torch.Tensor],
                      pieces: Iterable[int]) -> None:
        """Layer ``layer`` of ``pieces`` into ``cache`` (its wide views ``dst``), from this thread."""
        wide = self._wide_layers()
        if self._runs and pieces == range(len(self._slots)):
            runs, pieces = self._runs_of_wide
            for slots, views in runs:
                if (view := views.get(layer)) is not None:
                    dst[_WIDE][:, slots] = view
        for i in pieces:
            rows = wide[i]
            if layer not in self._layers[i]:
                continue
            if rows is None:
                scatter_layer(self._layers[i][layer], cache, self._slots[i], self._use_triton)
            else:
                dst[self._elements[i]].index_copy_(1, self._slots[i], rows[layer])

    @cached_property
    def _runs_of_wide(self) -> tuple[list[RunPart], list[int]]:
        """The runs whose pieces have 16-byte views and the pieces alone (``run_parts``)."""
        return run_parts(self._wide_layers(), self._slots, self._runs)

    def _scatter_share(self, caches: Sequence[torch.Tensor], dsts: Sequence[dict[torch.dtype, torch.Tensor]],
                       pieces: range,
                       before: Callable[[int], object] | None) -> None:
        """Every layer of ``pieces`` (a worker's share), calling ``before(layer)`` ahead of each."""
        for layer, (cache, dst) in enumerate(zip(caches, dsts)):
            if before is not None:
                before(layer)
            self._scatter_wide(layer, cache, dst, pieces)

    def _helpers(self) -> list[ThreadPoolExecutor]:
        """The copy threads a CPU scatter shares its pieces with (see ``_copy_threads``): none
        unless ``threads`` allows it and every piece is small enough that torch copies it on one thread."""
        if self._threads < 2 or len(self._chunks) < 2 or self._runs or \
                any(c.nbytes // max(1, c.shape[0]) > _ONE_THREAD_BYTES for c in self._chunks):
            return []  # one piece, or a run's op or big pieces: torch's own threads split them
        return _copy_threads(min(self._threads, len(self._chunks)) - 1)

    def _wide_layers(self) -> list[dict[int, torch.Tensor] | None]:
        """Per piece, its layers as wide elements (``_element``; None off the CPU or where
        impossible), made once."""
        if self._wide is None:
            self._wide = [None if not c.is_cpu or (w := _wide(c, e)) is None else dict(zip(ids, torch.unbind(w)))
                          for c, ids, e in zip(self._chunks, self._ids, self._elements)]
        return self._wide

    def gather_layer(self, layer: int, cache: torch.Tensor) -> None:
        """Fill layer ``layer`` of every piece holding it from ``cache``, that layer's cache (this thread only)."""
        self._gather_pieces(layer, cache, range(len(self._slots)))

    def _gather_pieces(self, layer: int, cache: torch.Tensor, pieces: Iterable[int]) -> None:
        """Layer ``layer`` of ``pieces`` (those holding it) from ``cache``, from this thread."""
        if not cache.is_cpu or _use_triton(self._use_triton, cache):
            for i in pieces:
                if layer in self._layers[i]:
                    gather_layer(cache, self._slots[i], self._layers[i][layer], self._use_triton)
            return
        flat = _flat(cache)
        for i in pieces:
            out = self._layers[i].get(layer)
            if out is None:
                continue
            if out.is_cpu and out.is_contiguous():
                torch.index_select(flat, 1, self._slots[i], out=out)
            else:
                out.copy_(flat.index_select(1, self._slots[i]), non_blocking=True)

    def _gather_share(self, caches: Sequence[torch.Tensor], pieces: range) -> None:
        """Every layer of ``pieces`` (a worker's share) from ``caches``."""
        for layer, cache in enumerate(caches):
            self._gather_pieces(layer, cache, pieces)

    def _gather_helpers(self, caches: Sequence[torch.Tensor]) -> list[ThreadPoolExecutor]:
        """The copy threads a CPU gather shares its pieces with (``_copy_threads``): none unless
        ``threads`` allows it, there are two pieces or more and caches and pieces are all host
        memory (no Triton). No size bound, unlike a scatter's: torch's CPU ``index_select``
        along the token dimension gains next to nothing from its own threads here. Measured on
        2 cores, 12 layers of 2048 tokens of the ``bench`` layout (48 MiB) at random slots: one
        ``index_select`` per layer, 15-18 ms with 1 or 2 torch threads alike; 8 pieces of 256
        tokens from one thread 15-16 ms, shared by two 8-10 ms (float16: 6.0 and 3.6 ms)."""
        if self._threads < 2 or len(self._chunks) < 2:
            return []
        if any(not c.is_cpu or _use_triton(self._use_triton, c) for c in caches) or \
                any(not c.is_cpu for c in self._chunks):
            return []
        return _copy_threads(min(self._threads, len(self._chunks)) - 1)

    def scatter(self, caches: Sequence[torch.Tensor], before: Callable[[int], object] | None = None) -> None:
        """Every layer of every piece into ``caches`` (one per layer; Triton: one launch per piece).

        ``before(layer)``, if given, is called ahead of that layer's copies (by each thread
        copying it: it must be thread-safe), e.g. to wait until the layer's data has landed.
        On the CPU the pieces are shared among the plan's ``threads``, each thread running
        through all layers (one hand-off per call, not one per layer)."""
        if caches and _use_triton(self._use_triton, caches[0]):
            for layer in range(len(caches)) if before is not None else ():
                before(layer)
            for chunk, slots, ids in zip(self._chunks, self._slots, self._ids):
                scatter(chunk, [caches[i] for i in ids], slots, use_triton=True)
            return
        dsts = [self._wide_cache(cache) for cache in caches]
        helpers = self._helpers() if all(d is not None for d in dsts) else []
        if not helpers:
            for layer, (cache, dst) in enumerate(zip(caches, dsts)):
                if before is not None:
                    before(layer)
                if dst is None:
                    self.scatter_layer(layer, cache)
                else:
                    self._scatter_wide(layer, cache, dst, range(len(self._slots)))
            return
        wide = cast(list[dict[torch.dtype, torch.Tensor]], dsts)
        _shared(helpers, len(self._slots), lambda share: self._scatter_share(caches, wide, share, before))

    def gather(self, caches: Sequence[torch.Tensor]) -> None:
        """Every layer of every piece from ``caches`` (one per layer; Triton: one launch per piece).

        On the CPU the pieces are shared among the plan's ``threads`` (piece i to thread
        i % threads, the caller's thread first), each thread running through all layers: one
        hand-off per call, not one per layer. The bytes are the same whatever ``threads``."""
        if caches and _use_triton(self._use_triton, caches[0]):
            for chunk, slots, ids in zip(self._chunks, self._slots, self._ids):
                gather([caches[i] for i in ids], slots, chunk, use_triton=True)
            return
        _shared(self._gather_helpers(caches), len(self._slots), lambda share: self._gather_share(caches, share))


def _shared(helpers: Sequence[ThreadPoolExecutor], count: int, work: Callable[[range], object]) -> None:
    """``work(share)`` for each worker's share of ``count`` pieces: piece i to worker
    i % (len(helpers) + 1), this thread being worker 0 and each helper the next; returns once
    every share is done (an error of any share propagates, after the others have ended)."""
    step = len(helpers) + 1
    futures = [pool.submit(work, range(k + 1, count, step)) for k, pool in enumerate(helpers)]
    try:
        work(range(0, count, step))
    finally:
        for future in futures:
            future.result()


_ONE_THREAD_BYTES = _GRAIN * 8
"""The most bytes of one layer of a piece that torch's ``index_copy_`` moves on one thread even as
8-byte elements (``_element``): a CPU scatter of such pieces shares them among ``CopyPlan``'s
``threads``; bigger ones torch splits itself (docs/benchmarks.md, "kvlayer against LMCache")."""

_pools: list[ThreadPoolExecutor] = []
_pools_lock = threading.Lock()


def _copy_threads(n: int) -> list[ThreadPoolExecutor]:
    """``n`` single-thread executors for CPU copies, made on first use and shared by every plan
    (torch releases the GIL while it copies). Each runs one piece list at a time, in order."""
    with _pools_lock:
        while len(_pools) < n:
            _pools.append(ThreadPoolExecutor(1, thread_name_prefix=f"kvlayer-copy-{len(_pools)}"))
        return _pools[:n]


def wait_for_copies(device: torch.device) -> None:
    """Block until the copies queued on ``device``'s current stream are done (a no-op off CUDA):
    call it before reading a host chunk ``gather`` filled or reusing one ``scatter`` read."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_Gather = Callable[[torch.Tensor | Sequence[torch.Tensor], torch.Tensor, torch.Tensor], None]


def _gather_staged(kernel: _Gather, caches: torch.Tensor | Sequence[torch.Tensor], cache: torch.Tensor,
                   slots: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``kernel(caches, slots, dst)`` into ``out`` itself when it can, else into a device
    buffer moved to ``out`` by one bulk copy."""
    if _direct(out, cache):
        kernel(caches, slots, out)
        return
    staging = torch.empty(out.shape, dtype=out.dtype, device=cache.device)
    kernel(caches, slots, staging)
    out.copy_(staging, non_blocking=True)
