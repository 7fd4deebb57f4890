"""The NVMe tier: one file per chunk under a folder, an LRU index in memory, warm restarts.

Enabled by ``nvme_path`` (``nvme_capacity`` bytes of files at most, ``nvme_fsync`` to flush
each file, ``compression: lz4`` to compress payloads, ``storage_quantization`` to store them as
int8 or fp8, lossy: ``kvlayer.quantize``). A file is the ``kvlayer.serde``
header then the payload; files are written atomically (``backends/nvme_files.py``) and the
index (``backends/nvme_index.py``) is rebuilt from their headers on first use, so a new
process on the same folder serves what an earlier one wrote. Reads run on worker threads
that a cancelled caller waits out (``backends/nvme_reads.py``). One process writes a folder at
a time: start-up deletes stray temporary files, which another live writer may own.

Per-chunk faults never raise out of a call: an unreadable, corrupt, misplaced or missing file is a
miss, counted (``io_errors``, ``checksum_errors``) and logged once per kind; a corrupt file
is deleted. A failed write (ENOSPC, EROFS, EACCES) is counted in ``write_errors`` and the
tier keeps serving reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from kvlayer import serde
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext, StorageBackend, check_batch

from . import nvme_files, nvme_reads
from .byte_reads import ChunkRead
from .nvme_index import IndexEntry, NvmeIndex

log = logging.getLogger(__name__)
T = TypeVar("T")

COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "puts", "evictions", "checksum_errors",
            "io_errors", "write_errors", "staging_full", "rejected", "scan_removed")
"""What ``stats()`` counts (``rejected``: puts that did not fit beside pinned chunks)."""

DEFAULT_CONCURRENCY = 4
"""Files read or written at once: each runs on a worker thread, and the target machine has 2 cores."""


class NvmeBackend(StorageBackend):
    """Chunks as files under ``root``, at most ``capacity`` bytes of them, LRU-evicted.

    Reads land in ``staging`` (one reference, owned by the caller); ``put_many`` only reads
    the caller's chunks. All methods run on kvlayer's I/O loop; the index is rebuilt from the
    folder on the first coroutine call (``keys``/``usage``/``stats`` report nothing before).
    """

    name = "nvme"
    rank = 20

    def __init__(self, root: str, capacity: int, layout: KVLayout, staging: Arena, *,
                 fsync: bool = False, compression: str = "none", quantization: str = "none",
                 concurrency: int = DEFAULT_CONCURRENCY) -> None:
        if compression not in serde.COMPRESSION_CODES:
            raise ValueError(f"compression must be one of {sorted(serde.COMPRESSION_CODES)}")
        if quantization not in serde.QUANTIZATION_CODES:
            raise ValueError(f"quantization must be one of {sorted(serde.QUANTIZATION_CODES)}")
        if concurrency <= 0:
            raise ValueError(f"concurrency must be positive, got {concurrency}")
        self.root = root
        self._layout = layout
        self._staging = staging
        self._fsync = fsync
        self._compression = compression
        self._quantization = quantization
        self._index = NvmeIndex(capacity)
        self._writing: set[bytes] = set()
        self._write_done = asyncio.Event()
        self._writes: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._scan_lock = asyncio.Lock()
        self._scanned = False
        self._closed = False
        self._stats: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))

    @classmethod
    def create(cls, ctx: BackendContext) -> NvmeBackend | None:
        """The tier from its settings (``ctx.tier_settings``: ``path``, ``capacity``, ``fsync``,
        declared in ``backends/settings.py``), or None when ``path`` is unset or ``capacity`` is 0. No I/O."""
        own, cfg = ctx.tier_settings(cls.name), ctx.config
        if not own["path"] or own["capacity"] == 0:
            return None
        root = os.path.abspath(os.path.expanduser(own["path"]))
        return cls(root, own["capacity"], ctx.layout, ctx.staging, fsync=own["fsync"],
                   compression=cfg.compression, quantization=cfg.storage_quantization)

    # --- the StorageBackend interface -------------------------------------------------
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        await self._ready()
        n = 0
        while n < len(keys) and keys[n].digest in self._index:
            n += 1
        return n

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        await self._ready()
        tasks = [asyncio.ensure_future(self._bounded(self._get_one, k)) for k in keys]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            await nvme_reads.cancel_and_release(tasks)
            raise

    async def read_layers(self, keys: Sequence[ChunkKey], outs: Sequence[MemoryObj],
                          groups: Sequence[tuple[int, int]], on_group: Callable[[int], None]) -> list[bool]:
        """``StorageBackend.read_layers`` with one ranged read per file and layer group (all
        files' group g, spread over the worker threads, before any file's group g + 1)."""
        await self._ready()
        if self._compression != "none" or self._quantization != "none":  # files read whole, then decoded
            return await super().read_layers(keys, outs, groups, on_group)
        entries = [self._index.get(k.digest) for k in keys]
        reads = [nvme_files.RangedFile(e.path, ChunkRead(k, o.shape, o.dtype, o.tensor))
                 if e is not None else None for k, e, o in zip(keys, entries, outs, strict=True)]
        for e in entries:
            if e is not None:
                e.readers += 1
        try:
            await nvme_reads.read_groups(reads, groups, self._concurrency, on_group)
            return [self._finished(k, e, r) for k, e, r in zip(keys, entries, reads)]
        finally:
            for e, r in zip(entries, reads):
                if e is not None:
                    e.readers -= 1
                if r is not None:
                    r.close()

    def _finished(self, key: ChunkKey, entry: IndexEntry | None, read: nvme_files.RangedFile | None) -> bool:
        """Count ``read``'s outcome, as ``_get_one`` does for a whole read."""
        ok = read is not None and entry is not None and read.chunk.verified()
        if ok:
            self._stats["bytes_read"] += entry.size
            self._index.touch(key.digest)
        elif read is not None and entry is not None:
            error = read.chunk.error
            if isinstance(error, serde.ChunkFormatError):
                self._corrupt(entry, error)
            elif error is not None:
                self._fault("io_errors", entry.path, error)
                if isinstance(error, FileNotFoundError):
                    self._forget(entry)
        self._stats["hits" if ok else "misses"] += 1
        return ok

    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Write each chunk not yet present; a chunk that fails to write is counted, not raised.

        ValueError when the lengths differ or a chunk's shape/dtype does not fit its key.
        """
        check_batch(keys, chunks, self._layout)
        await self._ready()
        # The writes go on if the caller stops waiting (a deadline): their threads read the
        # chunks, so they hold references of their own meanwhile.
        held = [c.ref() for c in chunks]
        task = asyncio.ensure_future(self._put_all(keys, held))
        self._writes.add(task)
        task.add_done_callback(lambda t: self._write_ended(t, held))
        await asyncio.shield(task)

    async def _put_all(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        await asyncio.gather(*(self._bounded(self._put_one, k, c) for k, c in zip(keys, chunks)))

    def _write_ended(self, task: asyncio.Task[None], held: Sequence[MemoryObj]) -> None:
        self._writes.discard(task)
        for c in held:
            c.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("nvme: a write failed unexpectedly", exc_info=task.exception())

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        await self._ready()
        gone = []
        for key in keys:
            entry = self._index.get(key.digest)
            if entry is not None and entry.pins == 0:
                self._drop(entry)
                gone.append(key.digest)
        self._evicted(gone)
        return len(gone)

    async def pin(self, keys: Sequence[ChunkKey]) -> int:
        await self._ready()
        n = 0
        for key in keys:
            entry = self._index.get(key.digest)
            if entry is not None:
                entry.pins += 1
                n += 1
        return n

    async def unpin(self, keys: Sequence[ChunkKey]) -> int:
        await self._ready()
        n = 0
        for key in keys:
            entry = self._index.get(key.digest)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                n += 1
        return n

    def pinned(self) -> dict[bytes, int]:
        entries = (self._index.get(d) for d in self._index.digests())
        return {e.digest: e.pins for e in entries if e is not None and e.pins > 0}

    def usage(self) -> tuple[int, int]:
        return self._index.used_bytes, self._index.capacity

    def keys(self) -> list[bytes]:
        return self._index.digests()

    def stats(self) -> dict[str, int]:
        """The ``COUNTERS``, plus ``chunks`` and ``used_bytes`` now."""
        out = dict(self._stats)
        out.update(chunks=len(self._index), used_bytes=self._index.used_bytes)
        return out

    async def close(self) -> None:
        """Finish the writes under way, then forget the index; the files stay for the next process."""
        self._closed = True
        await asyncio.gather(*self._writes, return_exceptions=True)
        self._index = NvmeIndex(self._index.capacity)

    # --- reads ----------------------------------------------------------------------------
    async def _get_one(self, key: ChunkKey) -> MemoryObj | None:
        obj = await self._read(key)
        self._stats["hits" if obj is not None else "misses"] += 1
        return obj

    async def _read(self, key: ChunkKey) -> MemoryObj | None:
        entry = self._index.get(key.digest)
        if entry is None:
            return None
        entry.readers += 1
        try:
            return await self._read_file(key, entry)
        except OSError as e:
            self._fault("io_errors", entry.path, e)
            if isinstance(e, FileNotFoundError):
                self._forget(entry)
            return None
        finally:
            entry.readers -= 1

    async def _read_file(self, key: ChunkKey, entry: IndexEntry) -> MemoryObj | None:
        """The chunk of ``entry``'s file in a new staging object, or None (counted; a bad file deleted)."""
        obj = self._staging.allocate(self._layout.chunk_shape(key.num_tokens, len(key.layers)), self._layout.dtype)
        if obj is None:
            self._fault("staging_full", entry.path, "the staging arena is full")
            return None
        try:
            n = await nvme_reads.fill(obj, nvme_files.load_chunk, entry.path, key, obj.tensor, entry.size,
                                      self._quantization)
        except serde.ChunkFormatError as e:
            self._corrupt(entry, e)
            return None
        self._stats["bytes_read"] += n
        self._index.touch(key.digest)
        return obj

    def _corrupt(self, entry: IndexEntry, err: Exception) -> None:
        self._fault("checksum_errors", entry.path, err)
        self._forget(entry)

    def _forget(self, entry: IndexEntry) -> None:
        """Drop a file that failed, unless the index moved on to another file meanwhile."""
        if self._index.get(entry.digest) is entry:
            self._drop(entry)
            self._evicted([entry.digest])

    # --- writes ---------------------------------------------------------------------------
    async def _put_one(self, key: ChunkKey, chunk: MemoryObj) -> None:
        digest = key.digest
        if digest in self._index or digest in self._writing:
            self._index.touch(digest)
            return
        self._writing.add(digest)
        try:
            await self._write(key, chunk)
        finally:
            self._writing.discard(digest)

    async def _write(self, key: ChunkKey, chunk: MemoryObj) -> None:
        tensor = chunk.tensor if chunk.tensor.device.type == "cpu" else chunk.tensor.cpu()
        # a raw chunk is encoded (checksummed) and written in one worker-thread hop
        size, parts = await nvme_files.chunk_parts(key, tensor, self._compression, self._quantization)
        path = nvme_files.chunk_path(self.root, key.digest, key.start)
        victims = await self._reserve(size)
        if victims is None:
            self._fault("rejected", path, f"{size} bytes do not fit beside the pinned chunks")
            return
        self._delete(victims)
        try:
            await nvme_files.write_file(path, parts, self._fsync)
        except OSError as e:
            self._fault("write_errors", path, e)
            return
        finally:
            self._index.unreserve(size)
            self._write_done.set()  # wakes the writers waiting in _reserve
            self._write_done = asyncio.Event()
        self._index.add(IndexEntry(key.digest, path, size, key.start))
        self._stats["puts"] += 1
        self._stats["bytes_written"] += size
        self._admitted([key.digest])

    async def _reserve(self, size: int) -> list[IndexEntry] | None:
        """Room for ``size`` bytes (the victims to delete), or None if pinned chunks leave none.

        While other writes are in flight their bytes cannot be evicted yet, so wait for them
        rather than give up.
        """
        while (victims := self._index.reserve(size)) is None and self._index.reserved_bytes:
            await self._write_done.wait()
        return victims

    def _delete(self, victims: Sequence[IndexEntry]) -> None:
        for v in victims:
            nvme_files.unlink_quietly(v.path)
        self._stats["evictions"] += len(victims)
        self._evicted([v.digest for v in victims])

    def _drop(self, entry: IndexEntry) -> None:
        self._index.pop(entry.digest)
        nvme_files.unlink_quietly(entry.path)

    # --- start-up, concurrency, accounting ------------------------------------------------
    async def _ready(self) -> None:
        """Rebuild the index from the folder once (in a worker thread); OSError if unusable."""
        if self._closed:
            raise RuntimeError("the nvme backend is closed")
        if self._scanned:
            return
        async with self._scan_lock:
            if self._scanned:
                return
            try:
                found = await asyncio.to_thread(nvme_files.scan, self.root)
            except OSError as e:
                self._fault("io_errors", self.root, e)
                raise
            for c in found.chunks:
                self._index.add(IndexEntry(c.digest, c.path, c.size, c.start))
            self._stats["scan_removed"] += found.removed
            self._stats["io_errors"] += found.unreadable
            self._scanned = True
            self._admitted([c.digest for c in found.chunks])
            self._delete(self._index.make_room(0) or [])  # the capacity may have shrunk
            log.info("nvme: %d chunks (%d bytes) found under %s, %d bad files removed",
                     len(self._index), self._index.used_bytes, self.root, found.removed)

    async def _bounded(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` once one of the concurrency slots is free."""
        async with self._slots:
            return await fn(*args)

    def _fault(self, kind: str, path: str, err: object) -> None:
        """Count one fault of ``kind`` in ``stats()``; ``_log_fault`` logs the first of each kind
        as a warning, later ones at debug level."""
        self._stats[kind] += 1
        self._log_fault(kind, "%s at %s: %s (counted; later ones are logged at debug level)", kind, path, err)

