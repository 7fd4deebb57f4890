"""The shared-memory arena file: a header carrying the server's epoch, then the chunks' bytes.

The server creates one file (mode 0600) under ``/dev/shm`` (the temporary folder where that is
absent) named after its socket and a fresh random epoch, and writes no chunk bytes itself but
those it promotes from its lower tiers: clients map the file and copy into and out of the ranges
the server grants, and the server only reads them back to seal and scrub them
(``kvlayer.cacheserver.scrub``). The header
(``HEADER``: magic, version, epoch, file size, where the data starts) lets a client refuse a
stale or foreign file: its epoch must be the one the server's ``HELLO`` answered. A server
killed without cleaning up leaves its file; the next server on the same socket removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"KVCSARNA"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
"""magic, version, header bytes, epoch, file bytes, data offset."""
DATA_OFFSET = 4096


class ArenaError(ValueError):
    """A mapped file whose header is not the one the server announced."""


def shm_dir() -> Path:
    """Where arena files live: ``/dev/shm`` (memory) where it exists, else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _stem(socket_path: str) -> str:
    tag = hashlib.blake2b(os.path.abspath(socket_path).encode(), digest_size=6).hexdigest()
    return f"kvlayer-cache-{os.getuid()}-{tag}-"


@dataclass(frozen=True, slots=True)
class ArenaFile:
    """The server's arena: ``path`` (``size`` bytes, data from ``data_offset``) of ``epoch``."""

    path: str
    epoch: int
    size: int
    data_offset: int

    @classmethod
    def create(cls, socket_path: str, capacity: int, folder: Path | None = None) -> ArenaFile:
        """A new file of ``capacity`` data bytes for the server of ``socket_path``, created 0600
        with a random epoch, after removing the files earlier servers of that socket left."""
        folder = folder or shm_dir()
        stem = _stem(socket_path)
        for stale in folder.glob(f"{stem}*"):
            with contextlib.suppress(OSError):
                stale.unlink()
        epoch = secrets.randbits(63) | 1
        path = folder / f"{stem}{epoch:016x}"
        size = DATA_OFFSET + capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, HEADER.pack(MAGIC, VERSION, HEADER.size, epoch, size, DATA_OFFSET), 0)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(str(path), epoch, size, DATA_OFFSET)

    def unlink(self) -> None:
        """Remove the file (mappings clients hold stay valid until they drop them)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def check_header(buffer: memoryview | bytes, epoch: int, size: int, data_offset: int) -> None:
    """``ArenaError`` unless ``buffer`` starts with the header of an arena of ``epoch``, ``size``
    bytes and data at ``data_offset``."""
    if len(buffer) < HEADER.size:
        raise ArenaError("arena file shorter than its header")
    magic, version, header, got_epoch, got_size, got_offset = HEADER.unpack_from(buffer)
    if magic != MAGIC or version != VERSION or header != HEADER.size:
        raise ArenaError("not a kvlayer cache-server arena")
    if (got_epoch, got_size, got_offset) != (epoch, size, data_offset):
        raise ArenaError(f"arena of epoch {got_epoch:x} ({got_size} bytes), expected {epoch:x} ({size} bytes)")


def epoch_of(buffer: memoryview | bytes) -> int:
    """The epoch a mapped header carries now."""
    return HEADER.unpack_from(buffer)[3]
