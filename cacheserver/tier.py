"""The ``cache`` tier: this process's view of a ``kvlayer cache-server``'s shared CPU tier.

Enabled by ``cache_server`` (a socket path; ``kvlayer.cacheserver.settings``). To the tier stack
it is a memory tier of the CPU's rank: stores land in it at once, loads read it whole. Every
chunk it hands out is a view of the server's shared arena (``kvlayer.cacheserver.client``):

- ``reserve`` gets ranges the engine's save gathers straight into; ``put_many`` commits them (one
  copy, engine -> arena). A chunk from elsewhere (staging, a lower tier) is copied into a fresh
  range first.
- ``get_many`` takes a lease per hit and answers the arena's own bytes (one copy, arena ->
  engine, by the caller), each checked against its epoch, and against its xxh3 checksum the
  first time this link reads that commit (``Link.is_verified``); releasing the object gives the
  lease back.

Failures: a server that is down, dies or refuses is an exception for the tier guard
(``kvlayer.tier_guard``): a miss, a counter, and the core's health backoff before the next try,
each of which connects again. Nothing here raises into the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch
import xxhash

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.client import Link
from kvlayer.cacheserver.protocol import Op, Status
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import MemoryObj, release_all
from kvlayer.storage import BackendContext, StorageBackend, check_batch

STATS_EVERY_S = 1.0
"""How often (at most) a call also asks the server for its accounting (``usage``, ``stats``)."""


def _wire_key(key: ChunkKey) -> wire.Key:
    return wire.Key(key.digest, key.tokens_digest)


def _batches(items: Sequence, n: int = wire.MAX_ITEMS) -> list[Sequence]:
    return [items[i:i + n] for i in range(0, len(items), n)]


class CacheServerBackend(StorageBackend):
    """The shared CPU tier of the server at ``socket_path``; rank 10, in memory."""

    name = "cache"
    rank = 10
    in_memory = True

    def __init__(self, socket_path: str, token: str | None, layout: KVLayout) -> None:
        self._path = socket_path
        self._token = token
        self._layout = layout
        self._link: Link | None = None
        self._connecting = asyncio.Lock()
        self._server = wire.Stats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        self._stats_at = 0.0
        self._counts = {"checksum_errors": 0, "bad_leases": 0, "skipped_full": 0, "connects": 0, "verified": 0}

    @classmethod
    def create(cls, ctx: BackendContext) -> CacheServerBackend | None:
        """The client of ``cache_server``, None when unset; connects lazily, on the I/O loop."""
        section = ctx.tier_settings(cls.name)
        if section["server"] is None:
            return None
        return cls(section["server"], section["server_token"], ctx.layout)

    # --- reads --------------------------------------------------------------------------
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the server holds (a lookup; no lease taken)."""
        link = await self._connected()
        n = 0
        for batch in _batches(keys):
            got = wire.parse_count(await link.call(Op.LOOKUP, wire.keys([_wire_key(k) for k in batch])))
            n += min(got, len(batch))
            if got < len(batch):
                break
        return n

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """A leased view of the arena per hit (one reference, the caller's: releasing it gives the
        lease back), None per miss; a range that fails its checks is a miss, counted."""
        link = await self._connected()
        out: list[MemoryObj | None] = []
        try:
            for batch in _batches(keys):
                leases = wire.parse_leases(await link.call(Op.LEASE, wire.keys([_wire_key(k) for k in batch])))
                if len(leases) != len(batch):
                    raise wire.ProtocolError(f"{len(leases)} leases for {len(batch)} keys")
                out += [self._adopt(link, key, lease) for key, lease in zip(batch, leases)]
        except BaseException:
            release_all(o for o in out if o is not None)
            raise
        await self._refresh(link)
        return out

    def _adopt(self, link: Link, key: ChunkKey, lease: wire.Lease) -> MemoryObj | None:
        if lease.status is not Status.OK:
            return None
        shape = self._layout.chunk_shape(key.num_tokens, len(key.layers))
        nbytes = _nbytes(shape, self._layout.dtype)
        if lease.size != nbytes or not link.in_data(lease.offset, nbytes, 16) or not link.epoch_ok():
            self._counts["bad_leases"] += 1
            self._log_fault("lease", "a lease of %d bytes at %d does not fit a %d-byte chunk of this arena",
                            lease.size, lease.offset, nbytes)
            link.release_later([key.digest])
            return None
        if not link.is_verified(lease.offset, key.digest, nbytes, lease.checksum):
            if self._checksum(link, lease.offset, nbytes) != lease.checksum:
                self._counts["checksum_errors"] += 1
                self._log_fault("checksum", "chunk %s fails its checksum", key.hex[:16])
                link.release_later([key.digest])
                return None
            link.verified(lease.offset, key.digest, nbytes, lease.checksum)
            self._counts["verified"] += 1
        return link.hand_out(lease.offset, key.digest, shape, self._layout.dtype, lease=True)

    # --- writes -------------------------------------------------------------------------
    async def reserve(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Ranges of the shared arena to gather ``keys``' chunks into (one reference each, the
        caller's; an unused one is released on the server with it); None for a chunk the server
        holds already and from the first it has no room for."""
        link = await self._connected()
        out: list[MemoryObj | None] = []
        try:
            for batch in _batches(keys):
                out += await self._reserve(link, batch, hand_out=True)
        except BaseException:
            release_all(o for o in out if o is not None)
            raise
        return out

    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Commit chunks ``reserve`` handed out (no copy), copy the others into new ranges and
        commit them; a key held already is left alone. The caller keeps its references."""
        await self._put(keys, chunks)

    async def promote_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> list[bool]:
        """``put_many`` (no admission policy yet); one flag per key, whether it was stored."""
        return await self._put(keys, chunks)

    async def _put(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> list[bool]:
        check_batch(keys, chunks, self._layout)
        link = await self._connected()
        stored = [False] * len(keys)
        adopt = [i for i, (k, c) in enumerate(zip(keys, chunks)) if link.reserved_for(c, k.digest)]
        adopted = set(adopt)
        commits: list[tuple[int, int]] = [(i, chunks[i].slot) for i in adopt]
        fresh: list[int] = []  # our own reservations for copies: released again if we fail
        try:
            for batch in _batches([i for i in range(len(keys)) if i not in adopted]):
                slots = await self._reserve(link, [keys[i] for i in batch], hand_out=False)
                for i, offset in zip(batch, slots):
                    if offset is not None:
                        fresh.append(i)
                        view = link.arena.buffer[offset:offset + chunks[i].nbytes].view(chunks[i].dtype)
                        view.copy_(chunks[i].tensor.reshape(-1))
                        commits.append((i, offset))
            for batch in _batches(commits):
                items = [(keys[i].digest, self._checksum(link, offset, chunks[i].nbytes)) for i, offset in batch]
                done = wire.parse_count(await link.call(Op.COMMIT, wire.commit(items)))
                if done != len(items):  # the server lost reservations it granted: trust none of it
                    link.broken()
                    raise ConnectionError(f"the cache server committed {done} of {len(items)} chunks")
                for i, offset in batch:
                    link.committed(offset)
                    stored[i] = True
        except BaseException:
            link.release_later([keys[i].digest for i in fresh if not stored[i]])
            raise
        self._admitted([keys[i].digest for i, ok in enumerate(stored) if ok])
        await self._refresh(link)
        return stored

    async def _reserve(self, link: Link, keys: Sequence[ChunkKey], hand_out: bool) -> list:
        """Reserve ``keys``: per key an object (``hand_out``) or the bare offset, None where refused."""
        sizes = [_nbytes(self._layout.chunk_shape(k.num_tokens, len(k.layers)), self._layout.dtype) for k in keys]
        body = wire.reserve([wire.Reserve(_wire_key(k), n, k.tenant) for k, n in zip(keys, sizes)])
        slots = wire.parse_slots(await link.call(Op.RESERVE, body))
        if len(slots) != len(keys):
            link.broken()
            raise wire.ProtocolError(f"{len(slots)} slots for {len(keys)} keys")
        out: list = []
        bad = []
        for key, size, slot in zip(keys, sizes, slots):
            if slot.status is not Status.OK:
                self._counts["skipped_full"] += slot.status is Status.FULL
                out.append(None)
            elif not link.in_data(slot.offset, size, 16):
                bad.append(key.digest)
                out.append(None)
            else:
                link.forget(slot.offset)  # whatever was verified there is gone
                shape = self._layout.chunk_shape(key.num_tokens, len(key.layers))
                out.append(link.hand_out(slot.offset, key.digest, shape, self._layout.dtype, lease=False)
                           if hand_out else slot.offset)
        if bad:
            self._counts["bad_leases"] += len(bad)
            link.release_later(bad)
        return out

    @staticmethod
    def _checksum(link: Link, offset: int, nbytes: int) -> int:
        return xxhash.xxh3_64_intdigest(link.view[offset:offset + nbytes])

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Remove the keys held and unleased (by any process); how many were removed."""
        link = await self._connected()
        n = 0
        for batch in _batches(keys):
            n += wire.parse_count(await link.call(Op.REMOVE, wire.digests([k.digest for k in batch])))
        self._evicted([k.digest for k in keys])
        return n

    # --- introspection ------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """The server's used and capacity bytes, as of its last answer (every process's chunks)."""
        return self._server.used_bytes, self._server.capacity_bytes

    def stats(self) -> dict[str, int]:
        """This client's counters (checksum_errors, bad_leases, skipped_full, connects, verified:
        leases hashed, held: live objects of this process) and the server's accounting as of its
        last answer (server_*)."""
        link = self._link
        server = {f"server_{k}": v for k, v in self._server._asdict().items() if k != "epoch"}
        return {**self._counts, "held": link.holding if link is not None else 0, **server}

    async def close(self) -> None:
        """Close the connection: the server releases every claim of this process."""
        if self._link is not None:
            self._link.close()
            self._link = None

    # --- the connection -----------------------------------------------------------------
    async def _connected(self) -> Link:
        """The live link, connecting (again) if there is none; raises when the server cannot be reached."""
        link = self._link
        if link is not None and link.alive:
            return link
        async with self._connecting:
            if self._link is None or not self._link.alive:
                self._link = None
                self._link = await Link.open(self._path, self._token)
                self._counts["connects"] += 1
                self._stats_at = 0.0
            link = self._link
        await self._refresh(link)
        return link

    async def _refresh(self, link: Link) -> None:
        now = time.monotonic()
        if now - self._stats_at >= STATS_EVERY_S:
            self._stats_at = now
            self._server = wire.parse_stats(await link.call(Op.STATS, b""))


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n
