"""What the cache server does with a controller command: its tiers as one admin surface.

``ServerTiers`` acts on the server's arena (tier ``cache``, its ``ChunkIndex``) and its lower
tiers (``cacheserver/lower.py``'s backends, by name), on the server's event loop. The keys of a
command are computed by the registration it came on (each announced namespace registers apart,
``cacheserver/controller_link.py``); the tiers only see their digests.

- evict / evict all: committed, unleased, unpinned chunks leave the tiers named (every tier if
  none); ``skipped_pinned`` counts the pinned ones kept.
- pin / unpin: an arena pin is a hold of no session (``ChunkIndex.hold``: kept from eviction and
  removal) counted per chunk; NVMe pins its files; Redis cannot pin (refused).
- list pins, per tier.
- copy and move are refused: the arena already writes every chunk through to each lower tier,
  and a lease promotes from them, so there is nothing cheap for an operator to ask for.

A failure is a reply with ``ok`` false (``agent_commands.failure``); nothing raises into the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence

from kvlayer.cacheserver.index import ChunkIndex, Entry
from kvlayer.cacheserver.lower import LowerTiers
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.agent_commands import MAX_LISTED_PINS, Done, check, command_salt, covered, failure, reply
from kvlayer.keys import ChunkKey
from kvlayer.storage import StorageBackend

ARENA = "cache"
"""The arena's tier name (the name its engine clients give their ``cache`` tier)."""
ACTIONS = frozenset({pb.ACTION_PIN, pb.ACTION_UNPIN, pb.ACTION_EVICT, pb.ACTION_EVICT_ALL, pb.ACTION_LIST_PINS,
                     pb.ACTION_COPY, pb.ACTION_MOVE})
NO_MOVES = ("the cache server moves no chunks between its tiers: its arena writes every chunk through to "
            "each lower tier, and a load promotes from them")
_NO_TOKENS = bytes(16)
KeysOf = Callable[[list[int], "str | None"], list[ChunkKey]]
"""(token ids, salt or None) -> the chunk keys of the registration a command came on."""


def _lower_key(digest: bytes) -> ChunkKey:
    """A lower tier's key for ``digest`` (its backends find a chunk by digest alone)."""
    return ChunkKey(digest, _NO_TOKENS, 0, 1)


class ServerTiers:
    """The arena ``index`` and the ``lower`` tiers (None: none) as the controller's commands see them."""

    def __init__(self, index: ChunkIndex, lower: LowerTiers | None) -> None:
        self.index = index
        self.lower: dict[str, StorageBackend] = {t.backend.name: t.backend for t in lower.tiers} if lower else {}
        self._pins: dict[bytes, list[tuple[bytes, Entry]]] = {}

    @property
    def names(self) -> list[str]:
        """The tiers, top first."""
        return [ARENA, *self.lower]

    def pinnable(self) -> list[str]:
        """The tiers that can pin (the arena, and NVMe)."""
        return [n for n in self.names if n == ARENA or type(self.lower[n]).pin is not StorageBackend.pin]

    def release_pins(self) -> None:
        """Undo every arena pin (the link closes)."""
        for held in self._pins.values():
            self.index.unhold(held)
        self._pins.clear()

    async def run(self, command: pb.Command, keys_of: KeysOf) -> pb.CommandReply:
        """Carry out ``command``; ``keys_of(token_ids, salt)`` gives its chunk keys. Never raises."""
        try:
            check(command, ACTIONS)
            keys = keys_of(list(command.token_ids), command_salt(command)) if command.token_ids else []
            return reply(command, await self._act(command, keys))
        except Exception as e:  # the controller gets the error; the server goes on
            return failure(command, e)

    async def _act(self, command: pb.Command, keys: list[ChunkKey]) -> Done:
        action = command.action
        if action in (pb.ACTION_COPY, pb.ACTION_MOVE):
            raise ValueError(NO_MOVES)
        if action == pb.ACTION_LIST_PINS:
            return self._list_pins(self._chosen(command.tier), keys if command.token_ids else None)
        if action in (pb.ACTION_PIN, pb.ACTION_UNPIN):
            return await self._pin(self._pin_tiers(command.tier), keys, action == pb.ACTION_PIN)
        tiers = self._chosen(command.tier) if command.tier else [t for t in self.names if t not in command.keep_tiers]
        if action == pb.ACTION_EVICT_ALL:
            return await self._evict_all(tiers)
        return await self._evict(tiers, keys)

    # --- selection --------------------------------------------------------------------------
    def _chosen(self, tier: str) -> list[str]:
        if not tier:
            return self.names
        if tier not in self.names:
            raise ValueError(f"unknown tier {tier!r}; this cache server has {self.names}")
        return [tier]

    def _pin_tiers(self, tier: str) -> list[str]:
        chosen = self._chosen(tier)
        if tier and tier not in self.pinnable():
            raise ValueError(f"tier {tier!r} cannot pin; tiers that can: {self.pinnable()}")
        return [t for t in chosen if t in self.pinnable()]

    # --- the actions --------------------------------------------------------------------------
    async def _evict(self, tiers: Sequence[str], keys: Sequence[ChunkKey]) -> Done:
        digests = [k.digest for k in keys]
        removed, skipped, held = await self._remove(tiers, digests)
        return Done(removed, covered(keys, len(keys)) if removed else 0, skipped, len(set(digests) - held))

    async def _evict_all(self, tiers: Sequence[str]) -> Done:
        removed, skipped, _ = await self._remove(tiers, None)
        return Done(removed, 0, skipped_pinned=skipped)

    async def _remove(self, tiers: Sequence[str], digests: list[bytes] | None) -> tuple[int, int, set[bytes]]:
        """Remove ``digests`` (None: every chunk) from ``tiers``, pinned ones kept: (removed, kept
        because pinned, the digests some tier held)."""
        removed = skipped = 0
        held: set[bytes] = set()
        for name in tiers:
            pins: Collection[bytes]
            if name == ARENA:
                committed = self.index.committed()
                present = committed if digests is None else list(set(digests) & set(committed))
                pins = self._pins.keys()
            else:
                backend = self.lower[name]
                present = await (asyncio.to_thread(backend.keys) if digests is None else _present(backend, digests))
                pins = backend.pinned().keys()
            held.update(present)
            skipped += sum(1 for d in present if d in pins)
            kept = [d for d in present if d not in pins]
            removed += self.index.remove(kept) if name == ARENA else await self.lower[name].remove(
                [_lower_key(d) for d in kept])
        return removed, skipped, held

    async def _pin(self, tiers: Sequence[str], keys: Sequence[ChunkKey], pin: bool) -> Done:
        n = 0
        for name in tiers:
            if name == ARENA:
                n += self._pin_arena(keys) if pin else self._unpin_arena(keys)
            else:
                backend = self.lower[name]
                lower = [_lower_key(k.digest) for k in keys]
                n += await (backend.pin(lower) if pin else backend.unpin(lower))
        return Done(n, covered(keys, len(keys)) if n else 0)

    def _pin_arena(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            held = self.index.hold([key.digest])  # committed chunks only
            if held:
                self._pins.setdefault(key.digest, []).extend(held)
                n += 1
        return n

    def _unpin_arena(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for key in keys:
            held = self._pins.get(key.digest)
            if held:
                self.index.unhold([held.pop()])
                n += 1
                if not held:
                    del self._pins[key.digest]
        return n

    def _list_pins(self, tiers: Sequence[str], keys: Sequence[ChunkKey] | None) -> Done:
        out = []
        for name in tiers:
            pins = {d: len(h) for d, h in self._pins.items()} if name == ARENA else self.lower[name].pinned()
            if name != ARENA and name not in self.pinnable():
                continue
            chunks = ([(d, n, 0) for d, n in pins.items()] if keys is None
                      else [(k.digest, pins[k.digest], k.end) for k in keys if k.digest in pins])
            out.append(pb.TierPins(tier=name, chunks=len(chunks), pins=sum(n for _, n, _ in chunks),
                                   listed=[pb.PinnedChunk(digest=d, pins=n, end=end)
                                           for d, n, end in chunks[:MAX_LISTED_PINS]]))
        return Done(sum(p.chunks for p in out), 0, pins=tuple(out))


async def _present(backend: StorageBackend, digests: Sequence[bytes]) -> list[bytes]:
    """The ``digests`` ``backend`` holds (one prefix probe per digest: a lower tier has no batch
    membership test but ``contains_prefix``)."""
    out = []
    for d in digests:
        if await backend.contains_prefix([_lower_key(d)]):
            out.append(d)
    return out
