"""The server's chunk index: byte ranges of the arena, LRU eviction, reservations and leases.

Pure bookkeeping (no I/O, no threads: the server's one event loop calls it). A chunk is first
*reserved* by a session (a range is allocated, invisible to lookups), then *committed* with its
checksum (visible, in the LRU order) or released (its range freed). A *lease* is a session's
claim to read a committed chunk: a leased chunk is never evicted nor removed. A session that
ends (its connection closed) gives back every lease and reservation it held, so the accounting
returns to what it was before it connected.

Eviction (a reservation that finds no free range): committed, unleased chunks in least recently
used order until a range fits; never a chunk of the batch being reserved. A batch is touched in
reverse order, so its first key (the head of a prefix chain) is the most recent and its tail
goes first.

Quotas (``quota`` bytes per tenant, the tag of a chunk's ``cache_salt``; the empty salt's is a
tenant too): a reservation that would take its tenant past the quota evicts that tenant's own
least recent unleased chunks first; if they do not make room, it is refused (FULL). Another
tenant's chunks are evicted only for a tenant within its quota.

Seals (``cacheserver/scrub.py`` does the hashing, off the loop): every commit waits, oldest
first, to be verified against its checksum (``to_seal``); a match *seals* it (``LEASE`` says so),
and sealed chunks are verified again, the one verified longest ago first (``to_rescrub``). A
chunk that fails (``checked``) is counted in ``checksum_errors`` and dropped; one under lease is
*spoiled* instead: lookups and leases miss it (a store of it answers PRESENT) until its last
lease is given back, and then it is dropped.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlayer.cacheserver.protocol import Key, Lease, Reserve, Slot, Status, TenantUsage

ALIGN = 256
"""Every range starts and ends on this many bytes (any dtype's view of a range is aligned)."""


def _aligned(size: int) -> int:
    """``size`` rounded up to ``ALIGN`` (the bytes ``FreeList`` gives a range of ``size``)."""
    return -(-size // ALIGN) * ALIGN


class FreeList:
    """First-fit allocation of aligned byte ranges of ``[base, base + size)``, coalescing frees."""

    def __init__(self, base: int, size: int) -> None:
        if base % ALIGN:
            raise ValueError(f"base {base} is not a multiple of {ALIGN}")
        self.base = base
        self.size = size - size % ALIGN
        self._starts = [base] if self.size else []
        self._ends = [base + self.size] if self.size else []
        self.used = 0

    def allocate(self, size: int) -> int | None:
        """The start of a free range of ``size`` bytes (rounded up to ``ALIGN``), or None."""
        need = -(-size // ALIGN) * ALIGN
        for i, (start, end) in enumerate(zip(self._starts, self._ends)):
            if end - start >= need:
                if end - start == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + need
                self.used += need
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Give back the range ``allocate`` returned for ``size`` bytes."""
        need = -(-size // ALIGN) * ALIGN
        end = start + need
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._ends[i] == self._starts[i + 1]:  # merge with the next
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._ends[i - 1] == self._starts[i]:  # and with the previous
            self._ends[i - 1] = self._ends.pop(i)
            del self._starts[i]
        self.used -= need


@dataclass(slots=True)
class Entry:
    """One chunk's range, tokens digest and checksum; committed once visible, leases by every session."""

    offset: int
    size: int
    tokens_digest: bytes
    tenant: bytes
    checksum: int = 0
    committed: bool = False
    leases: int = 0
    sealed: bool = False
    """The server hashed the committed bytes and found ``checksum``."""
    spoiled: bool = False
    """The bytes failed their checksum while leased: a miss, dropped with its last lease."""


@dataclass(slots=True)
class Session:
    """One connection's claims: reservations not yet committed and leases (counted per chunk)."""

    reserved: set[bytes] = field(default_factory=set)
    leases: Counter[bytes] = field(default_factory=Counter)


class ChunkIndex:
    """The chunks of one arena's data region ``[base, base + size)``; each tenant holds at most
    ``quota`` bytes (None: no bound; ``ValueError`` unless positive)."""

    def __init__(self, base: int, size: int, quota: int | None = None) -> None:
        if quota is not None and quota <= 0:
            raise ValueError(f"salt_quota must be positive, got {quota}")
        self.quota = quota
        self._space = FreeList(base, size)
        self._entries: dict[bytes, Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # committed chunks, least recent first
        self._unsealed: OrderedDict[bytes, None] = OrderedDict()  # commits to verify, oldest first
        self._sealed: OrderedDict[bytes, None] = OrderedDict()  # verified chunks, verified longest ago first
        self.evictions = 0
        self.refused = 0
        self.checksum_errors = 0
        self.listener: Callable[[bool, Sequence[bytes]], None] | None = None
        """Told ``(True, digests)`` of commits and ``(False, [digest])`` of committed chunks dropped
        (the server's controller link); cheap, never raising."""
        self.answers = Counter[str]()
        """Chunks asked for, by answer: ``lookup_hit``, ``lookup_miss`` (the keys after the held
        prefix), ``lease_hit``, ``lease_miss``."""
        self._tenant_bytes = Counter[bytes]()
        self._tenant_chunks = Counter[bytes]()
        self._tenant_refused = Counter[bytes]()

    @property
    def capacity(self) -> int:
        """Bytes of the data region (rounded down to ``ALIGN``)."""
        return self._space.size

    @property
    def used(self) -> int:
        """Bytes of allocated ranges (committed, reserved, or removed while leased)."""
        return self._space.used

    def counts(self) -> tuple[int, int, int]:
        """(committed chunks, spoiled ones included; reservations; leases)."""
        committed = len(self._lru)
        return committed, len(self._entries) - committed, sum(e.leases for e in self._entries.values())

    def committed(self) -> list[bytes]:
        """The digests of every committed chunk, least recently used first (a controller snapshot)."""
        return list(self._lru)

    @property
    def sealed(self) -> int:
        """Committed chunks verified by the server."""
        return len(self._sealed)

    def tenants(self) -> list[TenantUsage]:
        """Every tenant that holds a range or was refused one, most bytes first (the sum of their
        ``used_bytes`` is ``used``)."""
        names = set(self._tenant_bytes) | set(self._tenant_refused)
        out = [TenantUsage(t, self._tenant_bytes[t], self._tenant_chunks[t], self._tenant_refused[t]) for t in names]
        return sorted(out, key=lambda u: (-u.used_bytes, u.tenant))

    def lookup(self, keys: list[Key]) -> int:
        """How many leading ``keys`` are committed with their tokens digest."""
        n = 0
        for key in keys:
            if self._held(key) is None:
                break
            n += 1
        self._touch(keys[:n])
        self.answers["lookup_hit"] += n
        self.answers["lookup_miss"] += len(keys) - n
        return n

    def reserve(self, session: Session, items: list[Reserve] | list[tuple[Key, int]]) -> list[Slot]:
        """A range per item (sizes between 1 and the capacity, else ``ValueError``; a bare
        ``(key, size)`` is of the default tenant), or PRESENT for a chunk held or being stored, or
        FULL from the first item that no eviction allowed (capacity, or its tenant's quota) makes
        room for."""
        batch = [Reserve(*item) for item in items]
        for item in batch:
            if not 0 < item.size <= self.capacity:
                raise ValueError(f"size {item.size} outside 1..{self.capacity}")
        protect = {item.key.digest for item in batch}
        out: list[Slot] = []
        for key, size, tenant in batch:
            if out and out[-1].status is Status.FULL:
                out.append(Slot(Status.FULL, 0))
            elif key.digest in self._entries:
                out.append(Slot(Status.PRESENT, 0))
            elif (offset := self._allocate(size, protect, tenant)) is None:
                self.refused += 1
                self._tenant_refused[tenant] += 1
                out.append(Slot(Status.FULL, 0))
            else:
                self._entries[key.digest] = Entry(offset, size, key.tokens_digest, tenant)
                self._tenant_bytes[tenant] += _aligned(size)
                session.reserved.add(key.digest)
                out.append(Slot(Status.OK, offset))
        return out

    def commit(self, session: Session, items: list[tuple[bytes, int]]) -> int:
        """Make each of the session's reservations visible with its checksum; how many it committed
        (a digest the session did not reserve is ignored). The reservation becomes the session's
        lease: the writer may still read the chunk (a write-through to lower tiers), so it is not
        evicted until the writer releases it."""
        n = 0
        for digest, checksum in items:
            if digest in session.reserved:
                session.reserved.discard(digest)
                entry = self._entries[digest]
                entry.checksum, entry.committed = checksum, True
                self._tenant_chunks[entry.tenant] += 1
                entry.leases += 1
                session.leases[digest] += 1
                self._lru[digest] = None
                self._unsealed[digest] = None
                n += 1
                if self.listener is not None:
                    self.listener(True, [digest])
        return n

    def lease(self, session: Session, keys: list[Key]) -> list[Lease]:
        """A lease on each committed key (its range, checksum and seal), MISSING for the others."""
        out = []
        for key in keys:
            entry = self._held(key)
            if entry is None:
                out.append(Lease(Status.MISSING, 0, 0, 0))
                continue
            entry.leases += 1
            session.leases[key.digest] += 1
            out.append(Lease(Status.OK, entry.offset, entry.size, entry.checksum, entry.sealed))
        found = [k for k, x in zip(keys, out) if x.status is Status.OK]
        self._touch(found)
        self.answers["lease_hit"] += len(found)
        self.answers["lease_miss"] += len(keys) - len(found)
        return out

    def release(self, session: Session, digests: list[bytes]) -> int:
        """Give back one lease of each digest (or, if the session holds none, its reservation)."""
        n = 0
        for digest in digests:
            if session.leases[digest] > 0:
                session.leases[digest] -= 1
                if not session.leases[digest]:
                    del session.leases[digest]
                self._unlease(digest, 1)
                n += 1
            elif digest in session.reserved:
                session.reserved.discard(digest)
                self._drop(digest)
                n += 1
        return n

    def remove(self, digests: list[bytes]) -> int:
        """Remove each committed, unleased digest; how many were removed."""
        n = 0
        for digest in digests:
            entry = self._entries.get(digest)
            if entry is not None and entry.committed and entry.leases == 0:
                self._drop(digest)
                n += 1
        return n

    def end(self, session: Session) -> None:
        """The session's connection closed: release everything it held."""
        for digest, n in session.leases.items():
            self._unlease(digest, n)
        session.leases.clear()
        for digest in session.reserved:
            self._drop(digest)
        session.reserved.clear()

    # --- internals ----------------------------------------------------------------------
    def _held(self, key: Key) -> Entry | None:
        entry = self._entries.get(key.digest)
        if entry is None or not entry.committed or entry.spoiled or entry.tokens_digest != key.tokens_digest:
            return None
        return entry

    def _unlease(self, digest: bytes, n: int) -> None:
        """Give back ``n`` leases of ``digest``; a spoiled chunk goes with its last."""
        entry = self._entries[digest]
        entry.leases -= n
        if entry.spoiled and entry.leases == 0:
            self._drop(digest)

    def _touch(self, keys: list[Key]) -> None:
        for key in reversed(keys):
            self._lru.move_to_end(key.digest)

    def _allocate(self, size: int, protect: set[bytes], tenant: bytes) -> int | None:
        """A range for ``tenant``, evicting: its own chunks while it is over its quota, then any."""
        need = _aligned(size)
        while True:
            over = self.quota is not None and self._tenant_bytes[tenant] + need > self.quota
            if not over and (offset := self._space.allocate(size)) is not None:
                return offset
            victim = next((d for d in self._lru if d not in protect and self._entries[d].leases == 0
                           and (not over or self._entries[d].tenant == tenant)), None)
            if victim is None:
                return None
            self._drop(victim)
            self.evictions += 1

    def _drop(self, digest: bytes) -> None:
        entry = self._entries.pop(digest)
        self._lru.pop(digest, None)
        self._unline(digest)
        self._space.free(entry.offset, entry.size)
        self._tenant_bytes[entry.tenant] -= _aligned(entry.size)
        if not self._tenant_bytes[entry.tenant]:
            del self._tenant_bytes[entry.tenant]
        if entry.committed:
            self._tenant_chunks[entry.tenant] -= 1
            if not self._tenant_chunks[entry.tenant]:
                del self._tenant_chunks[entry.tenant]
            if self.listener is not None:
                self.listener(False, [digest])

    # --- the server's own claims (its lower tiers, cacheserver/lower.py) -------------------
    def hold(self, digests: list[bytes]) -> list[tuple[bytes, Entry]]:
        """Keep each committed digest from eviction and removal (one lease of no session each,
        undone by ``unhold``) while the server writes it to its lower tiers; the held entries."""
        out = []
        for digest in digests:
            entry = self._entries.get(digest)
            if entry is not None and entry.committed:
                entry.leases += 1
                out.append((digest, entry))
        return out

    def unhold(self, held: list[tuple[bytes, Entry]]) -> None:
        """Undo the ``hold`` that returned ``held``."""
        for digest, _ in held:
            self._unlease(digest, 1)  # held, so still indexed: only its last lease drops a spoiled one

    # --- seals (the hashing is cacheserver/scrub.py's) -------------------------------------
    def to_seal(self, max_bytes: int) -> list[tuple[bytes, Entry]]:
        """The oldest commits not yet verified, at least one (if any) and at most ``max_bytes``
        after the first; they stay in line until ``checked``."""
        return self._first(self._unsealed, max_bytes)

    def to_rescrub(self, max_bytes: int) -> list[tuple[bytes, Entry]]:
        """The sealed chunks verified longest ago, as ``to_seal`` takes them."""
        return self._first(self._sealed, max_bytes)

    def checked(self, results: list[tuple[bytes, Entry, int]]) -> list[bytes]:
        """Apply ``(digest, entry, xxh3 of its bytes)`` hashed off the loop: a match seals the
        chunk (verified now); a mismatch is counted and drops it (or spoils it while leased). A
        digest whose entry is no longer ``entry`` (evicted, removed, stored anew meanwhile) is
        skipped. The digests that failed."""
        bad = []
        for digest, entry, got in results:
            if self._entries.get(digest) is not entry or not entry.committed or entry.spoiled:
                continue
            if got == entry.checksum:
                self.seal(digest)
                continue
            bad.append(digest)
            self.checksum_errors += 1
            if not entry.leases:
                self._drop(digest)
                continue
            entry.spoiled, entry.sealed = True, False
            self._unline(digest)
        return bad

    def seal(self, digest: bytes) -> None:
        """Mark the committed ``digest`` verified now (the scrub's match, or a lower tier's
        checksummed read into the arena)."""
        self._entries[digest].sealed = True
        self._unline(digest)
        self._sealed[digest] = None  # the end of the line: verified last

    def _unline(self, digest: bytes) -> None:
        self._unsealed.pop(digest, None)
        self._sealed.pop(digest, None)

    def _first(self, line: OrderedDict[bytes, None], max_bytes: int) -> list[tuple[bytes, Entry]]:
        out: list[tuple[bytes, Entry]] = []
        total = 0
        for digest in line:
            entry = self._entries[digest]
            if out and total + entry.size > max_bytes:
                break
            out.append((digest, entry))
            total += entry.size
        return out
