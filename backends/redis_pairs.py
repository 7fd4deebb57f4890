"""How the Redis tier lays a chunk out in Redis: two keys, so Redis holds it without rounding it up.

Redis's allocator (jemalloc) rounds each string up to a size class, and a string costs its
bytes plus a small header and terminator. KV chunk payloads usually sit exactly on a class
(6 MiB, 32 MiB: powers of two and their quarter steps), so one value holding header + payload,
or even the bare payload, pays the next class: 17-25% more memory than the KV. Hence chunk K
lives in two keys in one hash slot (the ``{}`` hash tag: one cluster node, one ``MSETNX``)::

    head  <prefix>:{<K hex>}     the serde header + the payload's last tail_len(payload_len) bytes
    body  <prefix>:{<K hex>}:b   the payload's first payload_len - tail_len(payload_len) bytes

The body is a little smaller than the payload, so it fits the payload's own size class, and it
is a plain payload range: layer-group reads ask ``GETRANGE`` of it at payload offsets. The
serde format is unchanged (header, body, tail back to back are a chunk file's bytes; the
header's checksum covers the whole payload). Both keys are written together by ``MSETNX``
(both or neither), so the only half chunks are those where Redis evicted or expired one key:
readers treat them as misses (``HalfChunk``) and delete both keys.

Checking a pair: ``check_head`` is the one check of a head value (its serde header against the
key, shape and dtype; its size against the header, ``check_head_size``), ``check_body`` the
body's size. ``decode_pair`` turns a head and a body that redis-py read (cluster mode, and
compressed or quantized tiers) into a ``Reply``: any mismatch is a ``Reply`` with ``error`` set,
never data. The tier's fast path (``backends/redis_reads.py``) makes the same checks as the
bytes arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvlayer import serde
from kvlayer.keys import KEY_BYTES, ChunkKey
from kvlayer.memory import Arena, MemoryObj

TAIL = 128
"""Payload bytes kept in the head: more than a string's header and terminator take (about 10-20)."""


class HalfChunk(serde.ChunkFormatError):
    """Only one of a chunk's two keys holds a string (Redis evicted or expired the other)."""


class ChunkNames(NamedTuple):
    """The two Redis keys of one chunk."""

    head: bytes
    body: bytes


@dataclass(frozen=True, slots=True)
class Expected:
    """What a key's chunk must be: its key, shape, dtype and payload quantization, and the arena
    its copy goes to."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    staging: Arena
    quantization: str = "none"


@dataclass(frozen=True, slots=True)
class Reply:
    """A chunk read: ``obj`` on a hit (one reference, owned by the caller); ``stored`` whether
    either of its keys held a value; ``error`` why the values are not the key's chunk (a
    ``HalfChunk`` when one key is missing; ``stored`` with neither ``obj`` nor ``error``: the
    staging arena was full); ``nbytes`` the values' size."""

    obj: MemoryObj | None
    stored: bool
    error: serde.ChunkFormatError | None = None
    nbytes: int = 0


MISS = Reply(None, False)


def tail_len(payload_len: int) -> int:
    """How many of a ``payload_len``-byte payload's last bytes go to the head."""
    return min(TAIL, payload_len // 2)


def chunk_names(prefix: bytes, key: ChunkKey) -> ChunkNames:
    """The keys of ``key``'s chunk under ``prefix`` (which ends with ``:``)."""
    head = prefix + b"{" + key.hex.encode() + b"}"
    return ChunkNames(head, head + b":b")


def head_pattern(prefix: bytes) -> bytes:
    """A ``SCAN MATCH`` pattern for the heads under ``prefix``: one name per chunk."""
    return prefix + b"{*}"


def digest_of(prefix: bytes, name: bytes) -> bytes | None:
    """The chunk digest a head's name holds, or None for any other name."""
    if not (name.startswith(prefix + b"{") and name.endswith(b"}")):
        return None
    try:
        digest = bytes.fromhex(name[len(prefix) + 1 : -1].decode())
    except ValueError:
        return None
    return digest if len(digest) == KEY_BYTES else None


def split(header: bytes, payload: bytes | memoryview) -> tuple[bytes, memoryview]:
    """``(head value, body value)`` of a chunk: the body is a view of ``payload``, never a copy."""
    view = memoryview(payload).cast("B")
    cut = len(view) - tail_len(len(view))
    return header + bytes(view[cut:]), view[:cut]


def body_len(header: serde.ChunkHeader) -> int:
    """How many bytes the body of the chunk ``header`` describes holds."""
    return header.payload_len - tail_len(header.payload_len)


def check_head(head: bytes | memoryview, size: int, key: ChunkKey, shape: tuple[int, ...],
               dtype: torch.dtype, quantization: str = "none") -> serde.ChunkHeader:
    """The header of a ``size``-byte head value starting with ``head`` (at least its header
    bytes) if it is ``key``'s chunk of ``shape`` and ``dtype`` with a payload quantized as
    ``quantization`` says; ChunkFormatError if not."""
    header = serde.decode_header(head)
    serde.check_header(header, key, shape, dtype, quantization)
    check_head_size(header, size)
    return header


def check_head_size(header: serde.ChunkHeader, size: int) -> None:
    """ChunkFormatError unless a head value of ``size`` bytes fits ``header`` (it and the tail)."""
    expected = serde.HEADER_SIZE + tail_len(header.payload_len)
    if size != expected:
        raise serde.ChunkFormatError(f"head is {size} bytes, its header says {expected}")


def check_body(header: serde.ChunkHeader, size: int) -> None:
    """ChunkFormatError unless a body of ``size`` bytes fits ``header``."""
    if size != body_len(header):
        raise serde.ChunkFormatError(f"body is {size} bytes, its header says {body_len(header)}")


def decode_pair(head: Any, body: Any, want: Expected) -> Reply:
    """The ``Reply`` for a head and a body value redis-py read (bytes, or None for a missing key)."""
    if head is None and body is None:
        return MISS
    if not isinstance(head, bytes) or not isinstance(body, bytes):
        return Reply(None, True, HalfChunk(f"{'body' if body is None else 'head'} missing"), len(head or body or b""))
    nbytes = len(head) + len(body)
    try:
        header = check_head(head, len(head), want.key, want.shape, want.dtype, want.quantization)
        check_body(header, len(body))
    except serde.ChunkFormatError as e:
        return Reply(None, True, e, nbytes)
    return decoded(header, body + head[serde.HEADER_SIZE:], nbytes, want)


def decoded(header: serde.ChunkHeader, payload: bytes | memoryview, nbytes: int, want: Expected) -> Reply:
    """The ``Reply`` for values of ``nbytes`` bytes with a checked ``header`` and their whole
    ``payload`` (verified and decoded into a staging object)."""
    obj = want.staging.allocate(header.shape, header.dtype)
    if obj is None:
        return Reply(None, True, None, nbytes)
    try:
        serde.decode_payload(header, payload, obj.tensor)
    except serde.ChunkFormatError as e:
        obj.release()
        return Reply(None, True, e, nbytes)
    except BaseException:
        obj.release()
        raise
    return Reply(obj, True, None, nbytes)


def write_commands(names: ChunkNames, head: bytes, body: Any, ttl_s: int, multi: bool) -> list[tuple[Any, ...]]:
    """One chunk's write: ``MSETNX`` of both keys (both or neither), then their ``EXPIRE`` when
    ``ttl_s`` > 0, all in one ``MULTI`` transaction when ``multi``."""
    commands: list[tuple[Any, ...]] = [("MSETNX", names.head, head, names.body, body)]
    if ttl_s:
        commands += [("EXPIRE", name, ttl_s) for name in names]
        if multi:
            commands = [("MULTI",), *commands, ("EXEC",)]
    return commands


def msetnx_reply(replies: list[Any], multi: bool) -> Any:
    """The ``MSETNX`` reply among one chunk's write replies (1: written, 0: a key was there); in
    a ``MULTI``, the first of ``EXEC``'s (or ``EXEC``'s own error, e.g. EXECABORT after an OOM)."""
    if not multi:
        return replies[0]
    done = replies[-1]
    return done[0] if isinstance(done, list) else done
