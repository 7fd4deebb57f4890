"""Memory objects and the arenas they live in.

An ``Arena`` is one allocation made once (pinned host memory where CUDA exists, plain host
memory otherwise, or device memory), carved into equal slots of one chunk each: a slab
allocator, so churn never fragments it. It hands out its lowest free slot first, so chunks
allocated one after another mostly lie one slot apart, which a scatter copies as one op per
layer (``kvlayer.copy_runs``). A ``MemoryObj`` owns one slot and carries an
explicit reference count and pin count (docs/architecture.md section 4).

Ownership: ``Arena.allocate`` returns an object with ``ref_count == 1`` owned by the caller.
Whoever holds a reference calls ``release()`` exactly once for it (or uses the object as a
context manager); ``ref()`` takes another reference for a new holder. When the count reaches
zero the slot goes back to the arena. A pinned object must never be evicted by its tier;
pin and unpin calls must balance. Counts are guarded by the arena's lock, so objects can be
shared between the engine thread and the I/O loop.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


class MemoryObj:
    """One chunk's memory: a view ``[num_layers, planes, tokens, kv_heads, head_dim]`` into an arena slot."""

    __slots__ = ("arena", "slot", "shape", "dtype", "tensor", "_refs", "_pins")

    def __init__(self, arena: Arena, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.arena = arena
        self.slot = slot
        self.shape = shape
        self.dtype = dtype
        nbytes = _numel(shape) * _itemsize(dtype)
        start = slot * arena.slot_bytes
        self.tensor = arena.buffer[start : start + nbytes].view(dtype).view(shape)
        self._refs = 1
        self._pins = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def ref_count(self) -> int:
        return self._refs

    @property
    def pin_count(self) -> int:
        return self._pins

    def ref(self) -> MemoryObj:
        """Take one more reference (for a new holder); returns self."""
        with self.arena.lock:
            if self._refs <= 0:
                raise RuntimeError(f"ref() on a released MemoryObj (slot {self.slot})")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop one reference; the slot returns to the arena when none remain."""
        with self.arena.lock:
            if self._refs <= 0:
                raise RuntimeError(f"release() on a released MemoryObj (slot {self.slot})")
            if self._refs == 1 and self._pins:
                raise RuntimeError(f"last reference to MemoryObj slot {self.slot} released while pinned")
            self._refs -= 1
            if self._refs == 0:
                self.arena._free(self.slot)

    def pin(self) -> None:
        with self.arena.lock:
            self._pins += 1

    def unpin(self) -> None:
        with self.arena.lock:
            if self._pins <= 0:
                raise RuntimeError(f"unpin() of an unpinned MemoryObj (slot {self.slot})")
            self._pins -= 1

    def byte_view(self) -> memoryview:
        """The raw bytes (host arenas only), without copying."""
        if self.tensor.device.type != "cpu":
            raise ValueError("byte_view() needs a host arena")
        return memoryview(self.tensor.view(-1).view(torch.uint8).numpy())

    def __enter__(self) -> MemoryObj:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Arena:
    """``capacity_bytes`` of memory on ``device`` allocated once, in slots of ``slot_bytes``.

    ``pin=True`` asks for page-locked host memory; where CUDA is absent it falls back to plain
    memory with one log line (``pin_memory`` raises on CPU-only torch builds).
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int, device: torch.device | str = "cpu",
                 pin: bool = False, name: str = "arena") -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.device = torch.device(device)
        self.slot_bytes = _round_up(slot_bytes, 64)
        self.num_slots = capacity_bytes // self.slot_bytes
        self.lock = threading.RLock()
        total = self.num_slots * self.slot_bytes
        pinned = pin and self.device.type == "cpu" and torch.cuda.is_available()
        if pin and not pinned and self.device.type == "cpu":
            log.info("%s: CUDA is absent, using plain host memory instead of pinned memory", name)
        self.pinned = pinned
        self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device, pin_memory=pinned)
        self._free_slots = list(range(self.num_slots))  # a heap: the lowest free slot goes first

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def free_count(self) -> int:
        return len(self._free_slots)

    @property
    def used_count(self) -> int:
        return self.num_slots - len(self._free_slots)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> MemoryObj | None:
        """A new object of ``shape``/``dtype`` (ref_count 1, owned by the caller), or None when full."""
        need = _numel(shape) * _itemsize(dtype)
        if need > self.slot_bytes:
            raise ValueError(f"{self.name}: {need} bytes do not fit a {self.slot_bytes}-byte slot")
        with self.lock:
            if not self._free_slots:
                return None
            slot = heapq.heappop(self._free_slots)
        return MemoryObj(self, slot, tuple(shape), dtype)

    def prefault(self) -> None:
        """Touch every page now, so the first copies into the arena run at full speed."""
        self.buffer.zero_()

    def _free(self, slot: int) -> None:
        heapq.heappush(self._free_slots, slot)


def release_all(objs: Iterable[MemoryObj]) -> None:
    """Release one reference of each of ``objs`` (the caller's)."""
    for obj in objs:
        obj.release()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
