"""The ``cache`` tier: this process's view of a ``kvlayer cache-server``'s shared CPU tier.

Enabled by ``cache_server`` (a socket path; ``kvlayer.cacheserver.settings``). To the tier stack
it is a memory tier of the CPU's rank: stores land in it at once, loads read it whole. Every
chunk it hands out is a view of the server's shared arena (``kvlayer.cacheserver.client``):

- ``reserve`` gets ranges the engine's save gathers straight into; ``put_many`` commits them (one
  copy, engine -> arena). A chunk from elsewhere (staging, a lower tier) is copied into a fresh
  range first.
- ``get_many`` takes a lease per hit (naming the chunk's size and tenant, for a chunk the server
  promotes from its lower tiers) and answers the arena's own bytes (one copy, arena -> engine, by
  the caller), each checked against its epoch and bounds, and hashed (xxh3) as
  ``cache_server_verify`` says (``settings.VERIFY_RULES``): by default only a chunk the server
  has not sealed, once per commit and connection (``Link.is_verified``). Releasing the object
  gives the lease back.

Failures: a server that is down, dies or refuses is an exception for the tier guard
(``kvlayer.tier_guard``): a miss, a counter, and the core's health backoff before the next try,
each of which connects again. Nothing here raises into the engine.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.client import Link
from kvlayer.cacheserver.protocol import Op, Status
from kvlayer.cacheserver.settings import VERIFY_RULES
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import MemoryObj, release_all
from kvlayer.storage import BackendContext, StorageBackend, check_batch

HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads hashing the chunks of one lease batch side by side (at most 4, at most the cores)."""
STATS_EVERY_S = 1.0
"""How often (at most) a call also asks the server for its accounting (``usage``, ``stats``)."""


def _wire_key(key: ChunkKey) -> wire.Key:
    return wire.Key(key.digest, key.tokens_digest)


def _batches(items: Sequence, n: int = wire.MAX_ITEMS) -> list[Sequence]:
    return [items[i:i + n] for i in range(0, len(items), n)]


class CacheServerBackend(StorageBackend):
    """The shared CPU tier of the server at ``socket_path``; rank 10, in memory. ``verify``: one
    of ``settings.VERIFY_MODES`` (``KeyError`` otherwise)."""

    name = "cache"
    rank = 10
    in_memory = True

    def __init__(self, socket_path: str, token: str | None, layout: KVLayout,
                 device: torch.device | None = None, *, namespace: bytes = b"", verify: str = "server") -> None:
        self._path = socket_path
        self._namespace = namespace  # announced on each connect (wire.ANNOUNCE), when known
        self._device = device  # the engine's: on CUDA the mapped arena is registered as pinned memory
        self._token = token
        self._layout = layout
        self._verify = VERIFY_RULES[verify]
        self._link: Link | None = None
        self._connecting = asyncio.Lock()
        self._server = wire.Stats(*[0] * len(wire.Stats._fields))
        self._stats_at = 0.0
        self._counts = {"checksum_errors": 0, "bad_leases": 0, "skipped_full": 0, "connects": 0, "verified": 0,
                        "sealed_leases": 0}

    @classmethod
    def create(cls, ctx: BackendContext) -> CacheServerBackend | None:
        """The client of ``cache_server``, None when unset; connects lazily, on the I/O loop."""
        section = ctx.tier_settings(cls.name)
        if section["server"] is None:
            return None
        return cls(section["server"], section["server_token"], ctx.layout, ctx.device,
                   namespace=_announced(ctx), verify=section["server_verify"])

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
                wanted = [wire.Reserve(_wire_key(k), self._nbytes(k), k.tenant) for k in batch]
                leases = wire.parse_leases(await link.call(Op.LEASE, wire.reserve(wanted)))
                if len(leases) != len(batch):
                    raise wire.ProtocolError(f"{len(leases)} leases for {len(batch)} keys")
                fits = [self._fits(link, key, lease) for key, lease in zip(batch, leases)]
                good = await self._hashed(link, batch, leases, fits)
                out += [link.hand_out(lease.offset, key.digest, self._shape(key), self._layout.dtype, lease=True)
                        if ok else None for key, lease, ok in zip(batch, leases, good)]
        except BaseException:
            release_all(o for o in out if o is not None)
            raise
        await self._refresh(link)
        return out

    def _shape(self, key: ChunkKey) -> tuple[int, ...]:
        return self._layout.chunk_shape(key.num_tokens, len(key.layers))

    def _nbytes(self, key: ChunkKey) -> int:
        return _nbytes(self._shape(key), self._layout.dtype)

    def _fits(self, link: Link, key: ChunkKey, lease: wire.Lease) -> bool:
        """Whether a lease granted is a range of this arena's epoch of exactly the chunk's size;
        one that is not is released and counted."""
        if lease.status is not Status.OK:
            return False
        nbytes = self._nbytes(key)
        if lease.size == nbytes and link.in_data(lease.offset, nbytes, 16) and link.epoch_ok():
            return True
        self._counts["bad_leases"] += 1
        self._log_fault("lease", "a lease of %d bytes at %d does not fit a %d-byte chunk of this arena",
                        lease.size, lease.offset, nbytes)
        link.release_later([key.digest])
        return False

    async def _hashed(self, link: Link, keys: Sequence[ChunkKey], leases: Sequence[wire.Lease],
                      fits: Sequence[bool]) -> list[bool]:
        """Per lease, whether it may be handed out: it fits and its bytes match its checksum, hashed
        unless the verify rule trusts the server's seal or this link's record of that commit;
        hashes run on ``HASH_THREADS`` threads (xxhash releases the GIL). A range that fails is
        released and counted."""
        todo = [i for i, ok in enumerate(fits) if ok and self._to_hash(link, keys[i], leases[i])]
        sums = await _checksums(link, [(leases[i].offset, leases[i].size) for i in todo])
        good = list(fits)
        for i, got in zip(todo, sums):
            key, lease = keys[i], leases[i]
            if got != lease.checksum:
                good[i] = False
                self._counts["checksum_errors"] += 1
                self._log_fault("checksum", "chunk %s fails its checksum", key.hex[:16])
                link.release_later([key.digest])
                continue
            link.verified(lease.offset, key.digest, lease.size, lease.checksum)
            self._counts["verified"] += 1
        return good

    def _to_hash(self, link: Link, key: ChunkKey, lease: wire.Lease) -> bool:
        """Whether a lease that fits must be hashed before use (``sealed_leases`` counts those
        taken on the server's seal)."""
        rule = self._verify
        if rule.trust_seal and lease.sealed:
            self._counts["sealed_leases"] += 1
            return False
        return not (rule.trust_record and link.is_verified(lease.offset, key.digest, lease.size, lease.checksum))

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
                sums = await _checksums(link, [(offset, chunks[i].nbytes) for i, offset in batch])
                items = [(keys[i].digest, checksum) for (i, _), checksum in zip(batch, sums)]
                done = wire.parse_count(await link.call(Op.COMMIT, wire.commit(items)))
                if done != len(items):  # the server lost reservations it granted: trust none of it
                    link.broken()
                    raise ConnectionError(f"the cache server committed {done} of {len(items)} chunks")
                for (i, offset), (_, checksum) in zip(batch, items):
                    link.committed(offset)
                    if self._verify.record_writes:  # we hashed what we wrote
                        link.verified(offset, keys[i].digest, chunks[i].nbytes, checksum)
                    stored[i] = True
        except BaseException:
            link.release_later([keys[i].digest for i in fresh if not stored[i]])
            raise
        self._admitted([keys[i].digest for i, ok in enumerate(stored) if ok])
        await self._refresh(link)
        return stored

    async def _reserve(self, link: Link, keys: Sequence[ChunkKey], hand_out: bool) -> list:
        """Reserve ``keys``: per key an object (``hand_out``) or the bare offset, None where refused."""
        sizes = [self._nbytes(k) for k in keys]
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
        leases hashed, sealed_leases: leases used on the server's seal without hashing, held: live
        objects of this process, mapped: 1 once the link's mapping is prepared, ``Link.prefault``)
        and the server's accounting as of its last answer (server_*)."""
        link = self._link
        server = {f"server_{k}": v for k, v in self._server._asdict().items() if k != "epoch"}
        return {**self._counts, "held": link.holding if link is not None else 0,
                "mapped": int(link is not None and link.prefault.done), **server}

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
                self._link = await Link.open(self._path, self._token, self._device)
                if self._namespace:  # the server registers its chunks with the controller under it
                    await self._link.call(Op.ANNOUNCE, self._namespace)
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


def _announced(ctx: BackendContext) -> bytes:
    """The engine's key namespace as ``ANNOUNCE`` carries it (b"" where the context has none)."""
    if ctx.namespace is None:
        return b""
    from kvlayer.controller.wire import namespace_to_wire

    return namespace_to_wire(ctx.namespace, ctx.config.save_partial_chunks).SerializeToString(deterministic=True)


async def _checksums(link: Link, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The xxh3 checksum of the arena's bytes ``[offset, offset + nbytes)`` of each range, hashed
    side by side on ``_hash_pool`` (xxhash releases the GIL)."""
    loop = asyncio.get_running_loop()
    view = link.view
    return list(await asyncio.gather(*(loop.run_in_executor(_hash_pool(), xxhash.xxh3_64_intdigest,
                                                            view[offset:offset + n]) for offset, n in ranges)))


_hash_threads: list[ThreadPoolExecutor] = []
_hash_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """The executor that hashes leased chunks (``HASH_THREADS`` threads, made on first use, shared
    by every link of the process)."""
    with _hash_lock:
        if not _hash_threads:
            _hash_threads.append(ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvlayer-hash"))
        return _hash_threads[0]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n
