"""The storage interface every tier implements (docs/architecture.md section 5).

All methods are coroutines run on kvlayer's background I/O loop; batched forms are the
primitive. Keys are ``ChunkKey`` objects; a backend indexes by ``key.digest`` and stores
``key.tokens_digest`` with the chunk (in its header, for serialising tiers) so that a read
whose stored key or tokens digest does not match is a miss.

Ownership of chunks:
- ``get_many`` returns, for each key, a ``MemoryObj`` holding the chunk or ``None`` (a miss).
  Each returned object carries one reference owned by the caller, who must release it. A
  memory tier may return its own stored object (after ``ref()``); a tier that deserialises
  allocates it from ``BackendContext.staging``.
- ``put_many`` never takes over the caller's references: a memory tier ``ref()``s what it
  keeps (or copies it into its own arena), a serialising tier writes the bytes out. Putting
  a key that is already present is a no-op.

Errors: a backend raises on I/O failures it cannot turn into a miss itself; the tier manager
applies deadlines and turns every exception into a miss plus a counter. Corrupt data must
never be returned: a backend verifies headers and checksums (``kvlayer.serde``) and answers
``None`` (and counts it in ``stats()['checksum_errors']``) instead.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch

from kvlayer.config import KVLayerConfig
from kvlayer.keys import ChunkKey, Namespace
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj, release_all

log = logging.getLogger("kvlayer.backends")
_NO_SETTINGS: Mapping[str, Any] = MappingProxyType({})


def check_batch(keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj], layout: KVLayout) -> None:
    """``ValueError`` unless there is one chunk per key, each of its key's shape and ``layout.dtype``
    (what every backend's ``put_many`` checks before it stores anything)."""
    if len(keys) != len(chunks):
        raise ValueError(f"{len(keys)} keys but {len(chunks)} chunks")
    for key, chunk in zip(keys, chunks):
        want = layout.chunk_shape(key.num_tokens, len(key.layers))
        if tuple(chunk.shape) != want or chunk.dtype != layout.dtype:
            raise ValueError(f"chunk {tuple(chunk.shape)} {chunk.dtype} does not fit key "
                             f"{key.hex[:16]}: expected {want} {layout.dtype}")


@dataclass(frozen=True, slots=True)
class BackendContext:
    """What a backend is built from.

    ``staging`` is the host arena that serialising tiers land reads in (shared, internal, not
    a cache tier). ``device`` is the engine's device (the GPU tier's arena lives there).
    ``namespace`` is the engine's key namespace (None where a backend is built apart). A tier
    reads its own settings with ``tier_settings(cls.name)``; ``config`` holds the core's.
    """

    config: KVLayerConfig
    layout: KVLayout
    device: torch.device
    staging: Arena
    instance_id: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    namespace: Namespace | None = None

    def tier_settings(self, tier: str) -> Mapping[str, Any]:
        """Tier ``tier``'s own section of the config (``config.tiers[tier]``): every setting its
        ``kvlayer.tier_settings`` declaration names, typed and validated, defaults filled in, keyed
        by the names inside the section (``"path"``, not ``"nvme_path"``). Read-only. An empty
        mapping for a tier that declares no settings."""
        return self.config.tiers.get(tier, _NO_SETTINGS)


class TierListener(Protocol):
    """Told of chunks entering and leaving a tier (the controller agent listens)."""

    def on_admit(self, tier: str, digests: Sequence[bytes]) -> None: ...

    def on_evict(self, tier: str, digests: Sequence[bytes]) -> None: ...


class StorageBackend(abc.ABC):
    """One storage tier. Subclasses set ``name`` ("gpu", "cpu", "nvme", "redis").

    Backends call ``_admitted``/``_evicted`` when chunks enter or leave them (including
    removals), so a listener set with ``set_listener`` sees every change.
    """

    name: str = "?"
    rank: int = 100
    """Position in the hierarchy, top first: gpu 0, cpu 10, nvme 20, redis 30."""
    in_memory: bool = False
    """True for tiers whose ``put_many`` only copies into memory (gpu, cpu): the tier manager
    stores into the top one synchronously and writes the serialising tiers in the background."""
    _listener: TierListener | None = None

    @classmethod
    @abc.abstractmethod
    def create(cls, ctx: BackendContext) -> StorageBackend | None:
        """The tier built from ``ctx``, or None when ``ctx.config`` disables it.

        Must not block on I/O (a backend connects lazily on the I/O loop); a bad setting
        raises ``ValueError`` naming it.
        """

    def set_listener(self, listener: TierListener | None) -> None:
        self._listener = listener

    def _log_fault(self, kind: str, msg: str, *args: object) -> None:
        """Log the first fault of each ``kind`` as a warning and later ones at debug level (the
        backend counts every one in its ``stats()``), so a failing tier logs once, not per chunk."""
        seen = self.__dict__.setdefault("_faults_logged", set())
        log.log(logging.DEBUG if kind in seen else logging.WARNING, f"{self.name}: {msg}", *args)
        seen.add(kind)

    def _admitted(self, digests: Sequence[bytes]) -> None:
        if self._listener is not None and digests:
            self._listener.on_admit(self.name, digests)

    def _evicted(self, digests: Sequence[bytes]) -> None:
        if self._listener is not None and digests:
            self._listener.on_evict(self.name, digests)

    @abc.abstractmethod
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are present (stops at the first missing one)."""

    @abc.abstractmethod
    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """The chunks for ``keys`` (``None`` for each miss); see the module docstring for ownership."""

    async def read_layers(self, keys: Sequence[ChunkKey], outs: Sequence[MemoryObj],
                          groups: Sequence[tuple[int, int]], on_group: Callable[[int], None]) -> list[bool]:
        """Fill ``outs[i]`` (a host chunk of ``keys[i]``'s shape, owned by the caller) with that
        chunk, layer group by layer group (``kvlayer.read_plan``); per key, whether it is verified.

        ``groups`` are consecutive layer ranges ``[lo, hi)`` from layer 0. ``on_group(g)`` is
        called once per group, in order, when layers ``groups[g]`` of every out are written
        (for a key found missing or corrupt, with anything). A key whose flag is False is a
        miss and its out holds garbage; a flag is True only once the whole chunk is checked.
        Never returns, nor raises, while anything still writes into ``outs``; raises for a
        failure of the tier as a whole (every key then a miss). This default reads whole
        chunks with ``get_many`` and copies them: a serialising tier overrides it with ranged
        reads.
        """
        got = await self.get_many(keys)
        try:
            flags = []
            for obj, out in zip(got, outs, strict=True):
                if obj is not None:
                    out.tensor.copy_(obj.tensor)
                flags.append(obj is not None)
        finally:
            release_all(o for o in got if o is not None)
        for g in range(len(groups)):
            on_group(g)
        return flags

    @abc.abstractmethod
    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Store ``chunks[i]`` under ``keys[i]``; may evict unpinned chunks to make room."""

    async def promote_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> list[bool] | None:
        """Store chunks just read from a lower tier (the tier manager's promotions); ownership as
        in ``put_many``. A tier may decline some (an admission policy): it then answers which
        chunks it stored, one flag per key (None: all of them; the default, ``put_many``)."""
        await self.put_many(keys, chunks)
        return None

    async def reserve(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Host chunks of this tier's own memory for ``keys``, to be written in place and then
        stored with ``put_many``, which adopts them without a copy (a save's gather lands in
        the tier). One reference each, the caller's; an unused one is just released. None for
        a key the tier cannot give memory for; the default: None for every key."""
        return [None] * len(keys)

    @abc.abstractmethod
    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Remove the keys that are present and unpinned; returns how many were removed."""

    async def pin(self, keys: Sequence[ChunkKey]) -> int:
        """Protect present keys from eviction; returns how many were pinned. Default: none."""
        return 0

    async def unpin(self, keys: Sequence[ChunkKey]) -> int:
        """Undo one ``pin`` of each present, pinned key; returns how many were unpinned."""
        return 0

    def pinned(self) -> dict[bytes, int]:
        """Digest -> pin count of every pinned chunk (pins are counted: each ``pin`` needs its own
        ``unpin``). From memory, called on the I/O loop. Default: none (a tier that cannot pin)."""
        return {}

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """``(used_bytes, capacity_bytes)``; capacity 0 means the tier sets no bound of its own."""

    def keys(self) -> list[bytes]:
        """Digests of every chunk held (for controller snapshots); may be expensive."""
        return []

    def stats(self) -> dict[str, int]:
        """Backend-specific counters (e.g. ``checksum_errors``, ``evictions``) as plain ints."""
        return {}

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the backend is unusable afterwards."""

    async def get(self, key: ChunkKey) -> MemoryObj | None:
        return (await self.get_many([key]))[0]

    async def put(self, key: ChunkKey, chunk: MemoryObj) -> None:
        await self.put_many([key], [chunk])
