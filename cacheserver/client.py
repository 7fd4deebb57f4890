"""``Link``: one client connection to the cache server and its mapping of the server's arena.

Control messages go over the socket, one request at a time (an asyncio lock), on kvlayer's I/O
loop. KV bytes never do: ``Link.arena`` is the mapped arena file as a kvlayer ``Arena`` whose
"slots" are byte offsets, so a ``MemoryObj`` made at a granted offset is a view of the shared
memory that the engine copies into or out of directly.

Claims: each ``MemoryObj`` the link hands out is recorded per offset (``_Held``). When the last
object at an offset is released (from any thread), the link tells the server to drop the
leases taken for it, or the reservation that was never committed; these releases are batched
and sent from the loop. A link that fails mid-request (the server died, a deadline cancelled a
call) is *broken*: it is never used again, and its socket stays open until every object it
handed out is released, so the server cannot reuse ranges a reader may still be copying from.

Verification: the link records each leased chunk whose bytes this process hashed and found
right, as ``offset -> (digest, size, checksum)``; a later lease with the same four values is
not hashed again (docs/cache-server.md, "What is verified"). The record belongs to the link,
so a new connection (a new server, a new epoch) starts with none. Chunks this link writes are
not recorded: the writer, too, hashes its first read.

Mapping: once mapped, the arena is made ready in the background (``kvlayer.cacheserver.prefault``:
its data pages populated, or on a CUDA engine the whole mapping registered as pinned memory,
``kvlayer.cacheserver.pinned``), so a restarted engine's first reads do not fault; the link
stops that (and unregisters) when it closes for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlayer.cacheserver import pinned
from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.arena import HEADER, check_header, epoch_of
from kvlayer.cacheserver.prefault import Prefault
from kvlayer.cacheserver.protocol import Op
from kvlayer.memory import Arena, MemoryObj

MAX_VERIFIED = 1 << 16
"""The most verified-chunk records a link keeps (about 5 MiB of them)."""


class MappedArena(Arena):
    """The mapped arena file as an ``Arena`` of 1-byte slots (a slot is a byte offset). It never
    allocates: the server does. Releasing an object's last reference calls ``on_free(offset)``."""

    def __init__(self, buffer: torch.Tensor, name: str, on_free: Callable[[int], None]) -> None:
        super().__init__(0, 1, "cpu", name=name)
        self.slot_bytes = 1
        self.buffer = buffer
        self.num_slots = buffer.numel()
        self._on_free = on_free

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> MemoryObj | None:
        """Always None: the server allocates, through ``RESERVE``."""
        return None

    def _free(self, slot: int) -> None:
        self._on_free(slot)


@dataclass(slots=True)
class _Held:
    """The live objects at one offset and the server claims they stand for."""

    digest: bytes
    objs: int = 0
    leases: int = 0
    reserved: bool = False
    """A reservation not yet committed: released (freed on the server) with its last object."""


class Link:
    """A greeted connection with the arena mapped; make one with ``await Link.open(...)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 welcome: wire.Welcome, mapping: mmap.mmap, device: torch.device | None = None) -> None:
        self._reader, self._writer = reader, writer
        self.welcome = welcome
        self.mapping = mapping
        self.view = memoryview(mapping)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self.arena = MappedArena(buffer, f"cache server arena {welcome.epoch:016x}", self._freed)
        self.alive = True
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._held: dict[int, _Held] = {}
        self._pending: list[bytes] = []
        self._flushing = False
        self._verified: dict[int, tuple[bytes, int, int]] = {}  # offset -> (digest, size, checksum)
        self.prefault = self._prefault(device or torch.device("cpu"))
        """The background preparation of the mapping (``prefault.done``, ``.registered``)."""

    def _prefault(self, device: torch.device) -> Prefault:
        address, size = self.arena.buffer.data_ptr(), len(self.mapping)
        register = unregister = None
        if pinned.wanted(device):
            def register() -> bool:
                return pinned.register(address, size, device)

            def unregister() -> None:
                pinned.unregister(address, device)
        return Prefault(self.mapping, self.welcome.path, self.welcome.data_offset, register, unregister).start()

    @classmethod
    async def open(cls, path: str, token: str | None, device: torch.device | None = None) -> Link:
        """Connect, greet, map the arena and check its header, then start preparing the mapping in
        the background for an engine on ``device`` (pinned on CUDA); ``ConnectionError`` (or
        ``OSError``, ``ValueError``) when the server is absent, refuses us or announces a foreign arena."""
        reader, writer = await asyncio.open_unix_connection(path, limit=wire.MAX_BODY + wire.FRAME.size)
        try:
            writer.write(wire.frame(Op.HELLO, wire.hello(token)))
            await writer.drain()
            welcome = wire.parse_welcome(await _reply(reader, Op.HELLO))
            if welcome.version != wire.VERSION:
                raise ConnectionError(f"cache server speaks version {welcome.version}")
            mapping = _map(welcome)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, welcome, mapping, device)

    # --- requests -----------------------------------------------------------------------
    async def call(self, op: Op, body: bytes) -> bytes:
        """One request and its reply body. Any failure (or cancellation) breaks the link and is
        raised (``ConnectionError`` for a closed or refusing server)."""
        async with self._lock:
            if not self.alive:
                raise ConnectionError("the cache server link is broken")
            try:
                self._writer.write(wire.frame(op, body))
                await self._writer.drain()
                return await _reply(self._reader, op)
            except BaseException:
                self.broken()
                raise

    def epoch_ok(self) -> bool:
        """Whether the mapped header still carries the epoch the server announced."""
        return epoch_of(self.view[:HEADER.size]) == self.welcome.epoch

    def in_data(self, offset: int, size: int, align: int) -> bool:
        """Whether ``[offset, offset + size)`` is inside the data region, aligned to ``align``."""
        w = self.welcome
        return w.data_offset <= offset and offset + size <= w.arena_bytes and offset % align == 0 and size > 0

    # --- verified chunks ----------------------------------------------------------------
    def is_verified(self, offset: int, digest: bytes, size: int, checksum: int) -> bool:
        """Whether this link already hashed ``digest`` at ``offset`` and found this size and
        checksum. Loop thread only, as are ``verified`` and ``forget``."""
        return self._verified.get(offset) == (digest, size, checksum)

    def verified(self, offset: int, digest: bytes, size: int, checksum: int) -> None:
        """Record that the bytes at ``offset`` hashed to ``checksum`` (at most ``MAX_VERIFIED``
        records: past that the record starts over, and chunks are hashed again)."""
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()
        self._verified[offset] = (digest, size, checksum)

    def forget(self, offset: int) -> None:
        """Drop the record at ``offset``: the server granted it to a new reservation."""
        self._verified.pop(offset, None)

    # --- objects and claims -------------------------------------------------------------
    def hand_out(self, offset: int, digest: bytes, shape: tuple[int, ...], dtype: torch.dtype,
                 lease: bool) -> MemoryObj:
        """A new object (one reference, the caller's) viewing ``offset``, standing for a lease or
        (``lease=False``) for a reservation of ``digest``."""
        with self.arena.lock:
            held = self._held.setdefault(offset, _Held(digest))
            held.objs += 1
            held.leases += lease
            held.reserved |= not lease
        return MemoryObj(self.arena, offset, shape, dtype)

    def committed(self, offset: int) -> None:
        """The reservation at ``offset`` was committed: the server holds it as our lease now,
        released (``RELEASE``) with the last object viewing it."""
        with self.arena.lock:
            held = self._held.get(offset)
            if held is not None and held.reserved:
                held.reserved = False
                held.leases += 1

    def reserved_for(self, obj: MemoryObj, digest: bytes) -> bool:
        """Whether ``obj`` is one of this link's uncommitted reservations, of ``digest``."""
        with self.arena.lock:
            held = self._held.get(obj.slot) if obj.arena is self.arena else None
            return held is not None and held.reserved and held.digest == digest

    def release_later(self, digests: list[bytes]) -> None:
        """Queue ``RELEASE`` of ``digests`` (claims no object stands for)."""
        with self.arena.lock:
            self._pending += digests
        self._kick_threadsafe()

    @property
    def holding(self) -> int:
        """Offsets with live objects."""
        with self.arena.lock:
            return len(self._held)

    def broken(self) -> None:
        """Stop using this link; close its socket once no object of it is alive."""
        self.alive = False
        with self.arena.lock:
            idle = not self._held
        if idle:
            self._shut()

    def close(self) -> None:
        """Close the socket now (the server then releases every claim of this link) and stop
        preparing the mapping (a registration is undone)."""
        self.alive = False
        self._shut()

    def _shut(self) -> None:
        self.prefault.stop()
        self._writer.close()

    def _freed(self, offset: int) -> None:
        """The arena's free hook: runs under ``arena.lock``, on any thread."""
        held = self._held[offset]
        held.objs -= 1
        release = []
        if held.leases > held.objs:
            held.leases -= 1
            release.append(held.digest)
        if held.objs == 0:
            del self._held[offset]
            if held.reserved:
                release.append(held.digest)
        if not self.alive:
            if not self._held:
                self._call_soon(self._shut)
            return
        if release:
            self._pending += release
            self._kick_threadsafe()

    def _kick_threadsafe(self) -> None:
        self._call_soon(self._kick)

    def _call_soon(self, fn: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self._loop.call_soon_threadsafe(fn)

    def _kick(self) -> None:
        if not self._flushing and self._pending and self.alive:
            self._flushing = True
            self._loop.create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self.alive:
                with self.arena.lock:
                    batch, self._pending = self._pending[:wire.MAX_ITEMS], self._pending[wire.MAX_ITEMS:]
                if not batch:
                    return
                with contextlib.suppress(Exception):  # a failed link is broken: the server frees all
                    await self.call(Op.RELEASE, wire.digests(batch))
        finally:
            self._flushing = False


async def _reply(reader: asyncio.StreamReader, op: Op) -> bytes:
    try:
        got, length = wire.parse_header(await reader.readexactly(wire.FRAME.size))
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the cache server closed the connection") from None
    if got == Op.ERROR:
        code, message = wire.parse_error(body)
        raise ConnectionError(f"cache server refused {op.name} (error {code}): {message}")
    if got != op:
        raise wire.ProtocolError(f"reply op {got} to {op.name}")
    return body


def _map(welcome: wire.Welcome) -> mmap.mmap:
    """The arena file mapped read-write, checked against the server's announcement."""
    fd = os.open(welcome.path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != welcome.arena_bytes:
            raise ConnectionError(f"cache server arena {welcome.path}: not a file of {welcome.arena_bytes} bytes")
        mapping = mmap.mmap(fd, welcome.arena_bytes)
    finally:
        os.close(fd)
    check_header(mapping[:HEADER.size], welcome.epoch, welcome.arena_bytes, welcome.data_offset)
    return mapping
