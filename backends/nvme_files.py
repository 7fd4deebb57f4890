"""Chunk files of the NVMe tier: where they live, how they are written, read and found again.

Layout under the tier's root: ``<hex[0:2]>/<hex[2:4]>/<hex>-<start>.kvc`` where ``hex`` is
the key digest in hex and ``start`` the chunk's first token position. The chunk header
(``kvlayer.serde``) carries the key but not ``start``, which the eviction policy wants back
after a restart, so the name keeps it.

A file is written to ``.tmp-<random>`` in its final folder with plain ``os`` calls (encoded,
its blocks reserved and written on one worker thread, ``write_file``) and renamed into place
with ``os.replace``: a crash leaves at most a temporary file (removed by the next ``scan``),
never a half chunk under a real name. Only ``.kvc`` and ``.tmp-*`` files are ever deleted;
anything else under the root is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import os
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvlayer import serde
from kvlayer.keys import ChunkKey

from .byte_reads import ChunkRead

CHUNK_SUFFIX = ".kvc"
TEMP_PREFIX = ".tmp-"
IOV_MAX = 1024
"""The most buffers one ``preadv``/``writev`` takes (Linux's ``UIO_MAXIOV``); more go in turns."""
_NAME = re.compile(r"^([0-9a-f]{8,})-([0-9]+)\.kvc$")


def chunk_path(root: str, digest: bytes, start: int) -> str:
    """The path of the chunk file for key ``digest`` starting at token ``start``."""
    hx = digest.hex()
    return os.path.join(root, hx[:2], hx[2:4], f"{hx}-{start}{CHUNK_SUFFIX}")


def parse_chunk_name(name: str) -> tuple[bytes, int] | None:
    """``(digest, start)`` from a chunk file's name, or None if it is not one."""
    m = _NAME.match(name)
    if m is None or len(m.group(1)) % 2:
        return None
    return bytes.fromhex(m.group(1)), int(m.group(2))


@dataclass(frozen=True, slots=True)
class FoundChunk:
    """A chunk file that passed the start-up check (header valid, name and size match it)."""

    digest: bytes
    path: str
    size: int
    start: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What ``scan`` found: good chunks (oldest first) and how many files it removed or skipped."""

    chunks: list[FoundChunk]
    removed: int
    unreadable: int


def scan(root: str) -> ScanResult:
    """Find the chunk files under ``root`` (created if missing), reading headers only.

    Stray temporary files and chunk files whose header is invalid, names another key or
    promises another length are deleted. Files that cannot be read are skipped and counted.
    Blocking: run it in a worker thread. Raises OSError only when ``root`` itself is unusable.
    """
    os.makedirs(root, exist_ok=True)
    found: list[FoundChunk] = []
    removed = unreadable = 0
    for path, name in _files_at_depth_two(root):
        if name.startswith(TEMP_PREFIX):
            removed += unlink_quietly(path)
            continue
        parsed = parse_chunk_name(name)
        if parsed is None:
            continue
        try:
            chunk = _check_file(path, *parsed)
        except OSError:
            unreadable += 1
            continue
        if chunk is None:
            removed += unlink_quietly(path)
        else:
            found.append(chunk)
    found.sort(key=lambda c: c.mtime_ns)
    return ScanResult(found, removed, unreadable)


def _files_at_depth_two(root: str) -> list[tuple[str, str]]:
    out = []
    for top in _subdirs(root):
        for sub in _subdirs(top):
            with contextlib.suppress(OSError), os.scandir(sub) as it:
                out.extend((e.path, e.name) for e in it if e.is_file(follow_symlinks=False))
    return out


def _subdirs(path: str) -> list[str]:
    with contextlib.suppress(OSError), os.scandir(path) as it:
        return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    return []


def _check_file(path: str, digest: bytes, start: int) -> FoundChunk | None:
    """The file as a found chunk, or None when its header does not vouch for it."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        head = f.read(serde.HEADER_SIZE)
    try:
        header = serde.decode_header(head)
    except serde.ChunkFormatError:
        return None
    if header.key != digest or st.st_size != serde.HEADER_SIZE + header.payload_len:
        return None
    return FoundChunk(digest, path, st.st_size, start, st.st_mtime_ns)


Parts = Sequence[bytes | memoryview]
"""A file's contents as pieces written back to back (a chunk: its header, then its payload)."""


async def chunk_parts(key: ChunkKey, tensor: torch.Tensor, compression: str,
                      quantization: str) -> tuple[int, Parts | Callable[[], Parts]]:
    """``(file size, parts)`` of ``key``'s chunk file for the host chunk ``tensor``, for ``write_file``:
    a raw chunk's parts are ``serde.encode_chunk`` left to the writer's thread (its checksum is a
    pass over the payload); others are encoded now on a worker thread (ValueError as there)."""
    if compression == "none" and quantization == "none":
        size = serde.HEADER_SIZE + tensor.numel() * tensor.element_size()
        return size, functools.partial(serde.encode_chunk, key, tensor)
    header, payload = await asyncio.to_thread(serde.encode_chunk, key, tensor, compression, quantization)
    return len(header) + len(payload), (header, payload)


def write_parts(fd: int, parts: Parts) -> None:
    """Write ``parts`` back to back to the open file ``fd`` (``os.writev``, resumed after a short
    write): the seam tests inject faults at. OSError as the writes raise it. Blocking."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.writev(fd, views[:IOV_MAX])
        if n == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


async def write_file(path: str, parts: Parts | Callable[[], Parts], fsync: bool) -> None:
    """Atomically create ``path`` holding ``parts`` (or what ``parts()`` returns, called on the
    writer's thread), through a temporary file (``write_temp``, one worker-thread hop) renamed on
    this loop; with ``fsync`` the folder is flushed next, on a second hop. On any error (ENOSPC,
    EROFS, EACCES, an encoding's ValueError, cancellation) the temporary file is removed and the
    error propagates; ``path`` is then untouched (or removed again, when the folder's flush
    fails after the rename). Cancelled, it waits for its thread to end
    before it raises: the thread reads the caller's memory."""
    folder = os.path.dirname(path)
    fut = asyncio.get_running_loop().run_in_executor(None, write_temp, folder, parts, fsync)
    try:
        tmp = await asyncio.shield(fut)
    except asyncio.CancelledError:
        # whatever becomes of this task, the file the thread leaves goes
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() or unlink_quietly(f.result()))
        await asyncio.wait([fut])
        raise
    try:
        # Synchronous on purpose: a rename is one quick metadata call, and doing it inline
        # means a cancellation can never land between "renamed" and "known to be renamed".
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if fsync:
        try:
            await asyncio.to_thread(_fsync_dir, folder)
        except BaseException:
            unlink_quietly(path)  # the caller counts the write as failed: no file it does not know of
            raise


def write_temp(folder: str, parts: Parts | Callable[[], Parts], fsync: bool) -> str:
    """The path of a new temporary file in ``folder`` (made if missing) holding ``parts`` (or ``parts()``),
    flushed with ``fsync``, closed; on any error none is left. Blocking: run it in a worker thread."""
    pieces = parts() if callable(parts) else parts
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, TEMP_PREFIX + secrets.token_hex(8))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        try:
            _preallocate(fd, sum(memoryview(p).nbytes for p in pieces))
            write_parts(fd, pieces)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        unlink_quietly(tmp)
        raise
    return tmp


def _preallocate(fd: int, size: int) -> None:
    """Reserve the new file's blocks (Linux ``fallocate``; not ``os.posix_fallocate``, whose fallback
    writes a byte per block): 8 files of 6 MiB on ext4, 2 cores, took 17 ms instead of 21.5 on one
    thread, 10.2 instead of 12.3 on two. OSError where there is no room; else nothing if it fails."""
    fallocate = _fallocate()
    failed = fallocate is not None and size and fallocate(fd, 0, 0, size) != 0
    if failed and (err := ctypes.get_errno()) in (errno.ENOSPC, errno.EDQUOT):
        raise OSError(err, os.strerror(err))


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate`` (called without the GIL), or None off Linux or where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fn is not None:
        fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64), ctypes.c_int
    return fn


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_chunk(path: str, key: ChunkKey, out: torch.Tensor, file_size: int, quantization: str = "none") -> int:
    """Read the chunk file at ``path`` into ``out`` and verify it is ``key``'s; the bytes read.

    A raw chunk file in an exact tier (``file_size`` is the header plus ``out``'s bytes) is read
    with one ``readv`` straight into ``out`` as one range of the shared ranged read
    (``backends/byte_reads.py``), hashed there; any other file (lz4, quantized) is read whole,
    then decoded into ``out``. Raises ChunkFormatError when the file is not a valid chunk of
    ``key`` with ``out``'s shape and dtype and a payload quantized as ``quantization`` says,
    OSError when it cannot be read; ``out`` then holds garbage. Blocking: run it in a worker
    thread.
    """
    if quantization == "none" and file_size == serde.HEADER_SIZE + out.numel() * out.element_size():
        return _load_raw(path, ChunkRead(key, tuple(out.shape), out.dtype, out))
    data = memoryview(read_file(path))
    head, payload = data[: serde.HEADER_SIZE], data[serde.HEADER_SIZE :]
    header = serde.decode_header(head)
    serde.check_header(header, key, tuple(out.shape), out.dtype, quantization)
    serde.decode_payload(header, payload, out)
    return len(data)


def _load_raw(path: str, chunk: ChunkRead) -> int:
    """``load_chunk`` of a file the size of a raw chunk: header and payload in one ``readv``."""
    head = bytearray(serde.HEADER_SIZE)
    raw_end = serde.HEADER_SIZE + chunk.payload_len
    n = read_into(path, (head, chunk.claim(0, chunk.payload_len), bytearray(1)))
    if n > raw_end:
        raise serde.ChunkFormatError(f"the file is {n - raw_end} bytes longer than its chunk")
    if chunk.open(memoryview(head)[:n]) is not None and n == raw_end:
        chunk.landed(0, chunk.payload_len)
    if chunk.verified():
        return n
    raise chunk.error or serde.ChunkFormatError(f"the file ends at byte {n}, its chunk at {raw_end}")


def read_file(path: str) -> bytes:
    """The whole file, in one large read. Blocking: run it in a worker thread.

    Not aiofiles: a cancelled ``aiofiles.open`` leaves the descriptor it opened to the
    garbage collector, and one thread hop (open, read, close) beats three.
    """
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def read_into(path: str, buffers: Sequence[bytearray | memoryview]) -> int:
    """Fill ``buffers`` in order from the start of the file; the bytes read (less at its end).

    One ``readv`` call in the usual case, so a chunk lands in its destination with no copy.
    Blocking: run it in a worker thread.
    """
    with open(path, "rb", buffering=0) as f:
        return _preadv_all(f.fileno(), buffers, 0)


def _preadv_all(fd: int, buffers: Sequence[bytearray | memoryview], offset: int) -> int:
    """Fill ``buffers`` in order from ``offset`` of ``fd`` (one ``preadv`` in the usual case);
    the bytes read, less than their size only where the file ends."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views:
            views[0] = views[0][n:]
    return total


def unlink_quietly(path: str) -> bool:
    """Delete ``path``; False (no error) when it is already gone or cannot be deleted.

    Synchronous: an unlink is one quick metadata call, and doing it inline keeps the index
    and the folder in step (no other coroutine runs between the two).
    """
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


class RangedFile:
    """A raw chunk file read layer range by layer range into ``chunk``'s destination (the shared
    ranged read, ``backends/byte_reads.py``, which checks the header and keeps the checksum).

    ``read(lo, hi)`` reads layers ``[lo, hi)``, the first call also the header (with the first
    range in one ``preadv`` when that starts at layer 0) after checking the file's size; a fault
    (``OSError``, ``ChunkFormatError``) goes to ``chunk.error`` and ends the reads. ``close()``
    closes the file. Blocking: call ``read`` on a worker thread, one call at a time.
    """

    def __init__(self, path: str, chunk: ChunkRead) -> None:
        self.path = path
        self.chunk = chunk
        self._fd: int | None = None

    def read(self, lo: int, hi: int) -> None:
        """Read layers ``[lo, hi)`` into the chunk (nothing once its read failed)."""
        chunk = self.chunk
        if chunk.error is not None:
            return
        start, end = chunk.layer_span(lo, hi)
        window = chunk.claim(start, end)
        try:
            opening = self._fd is None
            if opening and not self._open_and_read(window if start == 0 else None):
                return
            if not (opening and start == 0):  # else the header's read brought these bytes too
                self._pread(window, serde.HEADER_SIZE + start)
        except (OSError, serde.ChunkFormatError) as e:
            chunk.fail(e)
            return
        chunk.landed(start, end)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _pread(self, window: memoryview, offset: int) -> None:
        assert self._fd is not None
        _pread_exactly(self._fd, [window], offset)

    def _open_and_read(self, first: memoryview | None) -> bool:
        """Open the file, check its size and header (read with ``first``, payload bytes from 0);
        whether the header was accepted."""
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        size, want = os.fstat(self._fd).st_size, serde.HEADER_SIZE + self.chunk.payload_len
        if size != want:
            raise serde.ChunkFormatError(f"the file is {size} bytes, a raw chunk {want}")
        head = bytearray(serde.HEADER_SIZE)
        _pread_exactly(self._fd, [head] if first is None else [head, first], 0)
        return self.chunk.open(head) is not None


def _pread_exactly(fd: int, buffers: Sequence[bytearray | memoryview], offset: int) -> None:
    """Fill ``buffers`` from ``offset`` of ``fd``; ChunkFormatError if the file ends first."""
    want = sum(len(b) for b in buffers)
    if _preadv_all(fd, buffers, offset) < want:
        raise serde.ChunkFormatError(f"the file ends before byte {offset + want}")
