"""The cache server's wire format (docs/architecture.md section 15): struct-packed frames, no pickle.

Every message is a frame: ``FRAME`` (``u8 op``, ``u8 flags`` = 0, ``u16`` = 0, ``u32 body length``)
then the body, little-endian. The client sends one request and reads its one reply (same op, or
``ERROR`` after which the server closes the connection). The first request must be ``HELLO``.

A key on the wire is ``KEY_BYTES``: the chunk key's 32-byte digest, then its 16-byte tokens
digest (a held chunk whose tokens digest differs is a miss). Bodies (``n`` is a ``u32`` count,
at most ``MAX_ITEMS``):

- ``HELLO``   ``4s magic, u16 version, u16 token length, token`` ->
              ``u16 version, u64 epoch, u64 arena bytes, u64 data offset, u16 path length, path``
- ``LOOKUP``  ``n, n x key`` -> ``u32 leading keys held``
- ``RESERVE`` ``n, n x (key, u64 size, 8s tenant)`` -> ``n, n x (u8 status, u64 offset)``
- ``COMMIT``  ``n, n x (digest, u64 checksum)`` -> ``u32 committed``
- ``LEASE``   ``n, n x (key, u64 size, 8s tenant)`` ->
              ``n, n x (u8 status, u8 flags, u64 offset, u64 size, u64 checksum)``
- ``RELEASE`` ``n, n x digest`` -> ``u32 released`` (a lease, or a reservation not committed)
- ``REMOVE``  ``n, n x digest`` -> ``u32 removed``
- ``STATS``   empty -> ``Stats`` as ``len(Stats._fields)`` x ``u64``
- ``TENANTS`` empty -> ``u64 quota bytes (0: none), n, n x (8s tenant, u64 used bytes, u64 chunks, u64 refused)``
- ``ANNOUNCE`` a client's key namespace, a controller.proto ``ModelNamespace`` (<= ``MAX_NAMESPACE``) -> ``u32`` 1
- ``ERROR``   ``u16 code, message (UTF-8)``

A ``LEASE`` item carries what the client expects: the chunk's size (0: not known, then only the
arena can answer it) and tenant, so a chunk the server promotes from its lower tiers is read at
that size (a stored chunk of another size is a miss) and accounted to that tenant. A lease's
``flags`` bit ``SEALED`` says the server hashed the chunk's arena bytes itself and found its
committed checksum (``cacheserver/scrub.py``): a client may use it without hashing it again.

A tenant is the ``TENANT_BYTES`` tag of a chunk's ``cache_salt`` (``kvlayer.keys.tenant_tag``),
never the salt; the server bounds each tenant's bytes by its ``salt_quota``.
Offsets are byte offsets in the arena file; the checksum is xxh3-64 of the chunk's bytes.
Decoders raise ``ProtocolError`` for any body that is not exactly what its op allows.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

VERSION = 3
"""2: ``RESERVE`` items carry their tenant; ``TENANTS``. 3: ``LEASE`` items carry size and tenant,
its reply the ``SEALED`` flag; ``Stats`` counts sealed chunks and checksum errors."""
MAGIC = b"KVCS"
FRAME = struct.Struct("<BBHI")
DIGEST_BYTES = 32
TOKENS_BYTES = 16
KEY_BYTES = DIGEST_BYTES + TOKENS_BYTES
TENANT_BYTES = 8
"""``kvlayer.keys.TENANT_BYTES`` (not imported: the server imports no engine module)."""
DEFAULT_TENANT = bytes(TENANT_BYTES)
"""The tenant of the empty salt."""
MAX_ITEMS = 8192
"""The most keys one frame carries (a client splits longer batches)."""
MAX_TOKEN = 1024
MAX_NAMESPACE = 65536  # bytes: a model of 4096 layers with per-layer windows fits
MAX_BODY = 4 + MAX_ITEMS * (KEY_BYTES + 8 + TENANT_BYTES)
"""The largest body either side reads; a longer one is a protocol error."""

_COUNT = struct.Struct("<I")
_HELLO = struct.Struct("<4sHH")
_WELCOME = struct.Struct("<HQQQH")
_SIZE = struct.Struct("<Q")
_SLOT = struct.Struct("<BQ")
_LEASE = struct.Struct("<BBQQQ")
SEALED = 1
"""``LEASE`` reply flag: the server verified the chunk's bytes against its checksum."""
_ERROR = struct.Struct("<H")
_RESERVE = struct.Struct(f"<Q{TENANT_BYTES}s")
_TENANT = struct.Struct(f"<{TENANT_BYTES}sQQQ")


class Op(enum.IntEnum):
    """A frame's op; a reply carries its request's op, or ``ERROR``."""

    HELLO = 1
    LOOKUP = 2
    RESERVE = 3
    COMMIT = 4
    LEASE = 5
    RELEASE = 6
    REMOVE = 7
    STATS = 8
    TENANTS = 9
    ANNOUNCE = 10
    ERROR = 255


class Status(enum.IntEnum):
    """Per-item answer of ``RESERVE`` and ``LEASE``."""

    OK = 0
    PRESENT = 1
    """Reserve: the chunk is held or being stored already (nothing to write)."""
    FULL = 2
    """Reserve: no room even after eviction (this and every later item of the frame)."""
    MISSING = 3
    """Lease: not held (or held for other tokens)."""


class ErrorCode(enum.IntEnum):
    """Why the server closed a connection (the ``ERROR`` frame's code)."""

    MALFORMED = 1
    BAD_VERSION = 2
    BAD_TOKEN = 3
    NOT_HELLO = 4


class ProtocolError(ValueError):
    """A frame that breaks the format; the connection it came on is closed."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.MALFORMED) -> None:
        super().__init__(message)
        self.code = code


class Key(NamedTuple):
    """A chunk key on the wire."""

    digest: bytes
    tokens_digest: bytes

    def pack(self) -> bytes:
        """The key's ``KEY_BYTES`` on the wire."""
        return self.digest + self.tokens_digest


class Reserve(NamedTuple):
    """One item of a ``RESERVE`` request: a chunk of ``size`` bytes of tenant ``tenant``."""

    key: Key
    size: int
    tenant: bytes = DEFAULT_TENANT


class Welcome(NamedTuple):
    """The server's answer to ``HELLO``: where its arena is and which epoch it carries."""

    version: int
    epoch: int
    arena_bytes: int
    data_offset: int
    path: str


class Slot(NamedTuple):
    """One item of a ``RESERVE`` reply: where to write the chunk (``OK``) or why not."""

    status: Status
    offset: int


class Lease(NamedTuple):
    """One item of a ``LEASE`` reply: where the chunk is, its size and checksum (``OK``), or
    ``MISSING``; ``sealed``: the server verified those bytes against that checksum."""

    status: Status
    offset: int
    size: int
    checksum: int
    sealed: bool = False


class Stats(NamedTuple):
    """The server's accounting, all counts."""

    epoch: int
    capacity_bytes: int
    used_bytes: int
    chunks: int
    reserved: int
    leases: int
    connections: int
    evictions: int
    refused: int
    sealed: int
    """Committed chunks whose bytes the server verified (``cacheserver/scrub.py``)."""
    checksum_errors: int
    """Chunks the server found not to match their committed checksum (and dropped)."""


_STATS = struct.Struct(f"<{len(Stats._fields)}Q")


class TenantUsage(NamedTuple):
    """One tenant's share of the arena: bytes of its ranges, its committed chunks, its refused reservations."""

    tenant: bytes
    used_bytes: int
    chunks: int
    refused: int


def frame(op: Op, body: bytes = b"") -> bytes:
    """One frame: the header then ``body``."""
    return FRAME.pack(op, 0, 0, len(body)) + body


def parse_header(header: bytes) -> tuple[int, int]:
    """``(op, body length)`` of a frame header; ``ProtocolError`` for nonzero padding or a body
    longer than ``MAX_BODY`` (the op itself is checked by whoever dispatches it)."""
    op, flags, pad, length = FRAME.unpack(header)
    if flags or pad:
        raise ProtocolError("nonzero frame padding")
    if length > MAX_BODY:
        raise ProtocolError(f"body of {length} bytes exceeds {MAX_BODY}")
    return op, length


# --- requests ----------------------------------------------------------------------------
def hello(token: str | None) -> bytes:
    """The body of ``HELLO``; ``ValueError`` for a token over ``MAX_TOKEN`` bytes."""
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN:
        raise ValueError(f"a cache server token is at most {MAX_TOKEN} bytes")
    return _HELLO.pack(MAGIC, VERSION, len(raw)) + raw


def parse_hello(body: bytes) -> tuple[int, bytes]:
    """``(version, token)``; ``ProtocolError`` for a bad magic or length."""
    if len(body) < _HELLO.size:
        raise ProtocolError("short hello")
    magic, version, n = _HELLO.unpack_from(body)
    if magic != MAGIC or len(body) != _HELLO.size + n or n > MAX_TOKEN:
        raise ProtocolError("malformed hello")
    return version, body[_HELLO.size:]


def keys(items: list[Key]) -> bytes:
    """The body of ``LOOKUP``."""
    return _COUNT.pack(len(items)) + b"".join(k.pack() for k in items)


def digests(items: list[bytes]) -> bytes:
    """The body of ``RELEASE`` and ``REMOVE``."""
    return _COUNT.pack(len(items)) + b"".join(items)


def reserve(items: list[Reserve] | list[tuple[Key, int]]) -> bytes:
    """The body of ``RESERVE`` and ``LEASE``: each key with its chunk's size in bytes and its tenant
    (a bare ``(key, size)`` is of ``DEFAULT_TENANT``); ``ValueError`` for a tenant not of ``TENANT_BYTES``."""
    out = [_COUNT.pack(len(items))]
    for item in items:
        r = Reserve(*item)
        if len(r.tenant) != TENANT_BYTES:
            raise ValueError(f"a tenant tag is {TENANT_BYTES} bytes, got {len(r.tenant)}")
        out.append(r.key.pack() + _RESERVE.pack(r.size, r.tenant))
    return b"".join(out)


def commit(items: list[tuple[bytes, int]]) -> bytes:
    """The body of ``COMMIT``: each reserved digest with the checksum of its bytes."""
    return _COUNT.pack(len(items)) + b"".join(d + _SIZE.pack(c) for d, c in items)


def _records(body: bytes, size: int) -> list[bytes]:
    """The ``n`` records of ``size`` bytes after a count; ``ProtocolError`` unless exact."""
    if len(body) < _COUNT.size:
        raise ProtocolError("missing count")
    (n,) = _COUNT.unpack_from(body)
    if n > MAX_ITEMS or len(body) != _COUNT.size + n * size:
        raise ProtocolError(f"{n} items do not match a body of {len(body)} bytes")
    return [body[4 + i * size: 4 + (i + 1) * size] for i in range(n)]


def parse_keys(body: bytes) -> list[Key]:
    """The keys of a ``LOOKUP`` body."""
    return [Key(r[:DIGEST_BYTES], r[DIGEST_BYTES:]) for r in _records(body, KEY_BYTES)]


def parse_digests(body: bytes) -> list[bytes]:
    """The digests of a ``RELEASE`` or ``REMOVE`` body."""
    return _records(body, DIGEST_BYTES)


def parse_reserve(body: bytes) -> list[Reserve]:
    """The items of a ``RESERVE`` or ``LEASE`` body (sizes are checked by the index, or by what
    a lower tier reads)."""
    return [Reserve(Key(r[:DIGEST_BYTES], r[DIGEST_BYTES:KEY_BYTES]), *_RESERVE.unpack_from(r, KEY_BYTES))
            for r in _records(body, KEY_BYTES + _RESERVE.size)]


def parse_commit(body: bytes) -> list[tuple[bytes, int]]:
    """The (digest, checksum) items of a ``COMMIT`` body."""
    return [(r[:DIGEST_BYTES], _SIZE.unpack_from(r, DIGEST_BYTES)[0]) for r in _records(body, DIGEST_BYTES + 8)]


def _status(value: int) -> Status:
    try:
        return Status(value)
    except ValueError:
        raise ProtocolError(f"unknown status {value}") from None


def parse_empty(body: bytes) -> None:
    """``ProtocolError`` unless the body is empty (``STATS``)."""
    if body:
        raise ProtocolError("unexpected body")


# --- replies -----------------------------------------------------------------------------
def welcome(w: Welcome) -> bytes:
    """The body of the reply to ``HELLO``."""
    raw = w.path.encode()
    return _WELCOME.pack(w.version, w.epoch, w.arena_bytes, w.data_offset, len(raw)) + raw


def parse_welcome(body: bytes) -> Welcome:
    """The reply to ``HELLO``."""
    if len(body) < _WELCOME.size:
        raise ProtocolError("short welcome")
    version, epoch, size, offset, n = _WELCOME.unpack_from(body)
    if len(body) != _WELCOME.size + n:
        raise ProtocolError("malformed welcome")
    return Welcome(version, epoch, size, offset, body[_WELCOME.size:].decode())


def count(n: int) -> bytes:
    """A reply that is one count."""
    return _COUNT.pack(n)


def parse_count(body: bytes) -> int:
    """The count of a reply that is one."""
    if len(body) != _COUNT.size:
        raise ProtocolError("malformed count")
    return _COUNT.unpack(body)[0]


def slots(items: list[Slot]) -> bytes:
    """The body of the reply to ``RESERVE``."""
    return _COUNT.pack(len(items)) + b"".join(_SLOT.pack(*s) for s in items)


def parse_slots(body: bytes) -> list[Slot]:
    """The reply to ``RESERVE``."""
    return [Slot(_status(s), o) for s, o in (_SLOT.unpack(r) for r in _records(body, _SLOT.size))]


def leases(items: list[Lease]) -> bytes:
    """The body of the reply to ``LEASE``."""
    return _COUNT.pack(len(items)) + b"".join(_LEASE.pack(x.status, SEALED if x.sealed else 0, x.offset, x.size,
                                                          x.checksum) for x in items)


def parse_leases(body: bytes) -> list[Lease]:
    """The reply to ``LEASE``; ``ProtocolError`` for an unknown flag."""
    out = []
    for s, flags, o, n, c in (_LEASE.unpack(r) for r in _records(body, _LEASE.size)):
        if flags & ~SEALED:
            raise ProtocolError(f"unknown lease flags {flags:#x}")
        out.append(Lease(_status(s), o, n, c, bool(flags & SEALED)))
    return out


def stats(s: Stats) -> bytes:
    """The body of the reply to ``STATS``."""
    return _STATS.pack(*s)


def parse_stats(body: bytes) -> Stats:
    """The reply to ``STATS``."""
    if len(body) != _STATS.size:
        raise ProtocolError("malformed stats")
    return Stats(*_STATS.unpack(body))


def tenants(quota: int, items: list[TenantUsage]) -> bytes:
    """The body of the reply to ``TENANTS``: the quota (0: none), then each tenant's usage."""
    return _SIZE.pack(quota) + _COUNT.pack(len(items)) + b"".join(_TENANT.pack(*t) for t in items)


def parse_tenants(body: bytes) -> tuple[int, list[TenantUsage]]:
    """The reply to ``TENANTS``: (quota bytes, 0 for none; the tenants)."""
    if len(body) < _SIZE.size:
        raise ProtocolError("malformed tenants")
    return _SIZE.unpack_from(body)[0], [TenantUsage(*_TENANT.unpack(r))
                                        for r in _records(body[_SIZE.size:], _TENANT.size)]


def error(code: ErrorCode, message: str) -> bytes:
    """The body of an ``ERROR`` frame (the message cut to 200 bytes)."""
    return _ERROR.pack(code) + message.encode()[:200]


def parse_error(body: bytes) -> tuple[int, str]:
    """(code, message) of an ``ERROR`` frame."""
    if len(body) < _ERROR.size:
        raise ProtocolError("malformed error")
    return _ERROR.unpack_from(body)[0], body[_ERROR.size:].decode(errors="replace")
