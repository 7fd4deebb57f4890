"""``Prefault``: a client's mapping of the arena made ready in a background thread, so first reads do not fault.

A new process that maps the arena pays a page fault per 4 KiB page on its first touch of each
(shmem THP is usually off), which a restarted engine's first retrieve would otherwise pay on the
I/O loop. ``Prefault`` runs once per mapping, on its own daemon thread, never on the I/O loop:

1. ``madvise(MADV_HUGEPAGE)`` over the mapping (harmless where shmem THP is off; refused: ignored).
2. On CUDA, ``register`` (``kvlayer.cacheserver.pinned``): page-locking faults every page in, so
   when it succeeds nothing else is done.
3. Otherwise ``madvise(MADV_POPULATE_READ)`` (Linux >= 5.14) over the file's data extents only
   (``SEEK_DATA``/``SEEK_HOLE``): a read fault on a tmpfs hole allocates the page, so populating
   holes would make the whole arena resident at the first connect. At most ``PIECE`` bytes per
   call, so ``stop`` ends it within one piece. A kernel that refuses it: stopped silently.

``stop`` may come from any thread, at any time; a registration that finishes after it is undone
by the thread itself (``unregister``). ``wait`` lets tests and benches see it done.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux's value where Python's ``mmap`` lacks the constant (before 3.13)."""
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
PIECE = 64 << 20
"""The most bytes one populate call covers (about 4 ms of faulting on a 2-core machine)."""

Register = Callable[[], bool]
"""Page-locks the whole mapping (True when it did); runs on the prefault thread."""


class Prefault:
    """Prepares ``mapping`` (the arena file at ``path``) from ``start`` on a daemon thread; see the
    module docstring. ``register`` (optional) page-locks it instead of populating, and
    ``unregister`` undoes that."""

    def __init__(self, mapping: mmap.mmap, path: str, start: int, register: Register | None = None,
                 unregister: Callable[[], None] | None = None) -> None:
        self._mapping = mapping
        self._path = path
        self._start = start - start % mmap.PAGESIZE
        self._register, self._unregister = register, unregister
        self._stopped = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.registered = False
        """Whether the mapping is page-locked now (until ``stop``)."""
        self.populated = 0
        """Bytes of data extents populated so far."""
        self._thread = threading.Thread(target=self._run, name="kvlayer-prefault", daemon=True)

    def start(self) -> Prefault:
        """Start the thread (once)."""
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        """Whether the thread finished (prepared, refused or stopped)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for ``done``; whether it is."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Stop populating (within one piece) and undo a registration; idempotent, any thread."""
        self._stopped.set()
        with self._lock:
            registered, self.registered = self.registered, False
        if registered and self._unregister is not None:
            self._unregister()

    def _run(self) -> None:
        try:
            with contextlib.suppress(OSError, ValueError):
                self._mapping.madvise(MADV_HUGEPAGE)
            if self._register is not None and not self._stopped.is_set() and self._register():
                with self._lock:
                    self.registered = not self._stopped.is_set()
                if not self.registered and self._unregister is not None:
                    self._unregister()  # stopped while it registered: undo it here
                return
            self._populate()
        finally:
            self._done.set()

    def _populate(self) -> None:
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return  # the server removed its file: nothing worth reading is left in it
        try:
            for lo, hi in _extents(fd, self._start, len(self._mapping)):
                for at in range(lo, hi, PIECE):
                    if self._stopped.is_set():
                        return
                    n = min(PIECE, hi - at)
                    self._mapping.madvise(MADV_POPULATE_READ, at, n)
                    self.populated += n
        except (OSError, ValueError):
            return  # an old kernel (EINVAL), a closed mapping: the pages fault on first use instead
        finally:
            os.close(fd)


def _extents(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The page-aligned ``[lo, hi)`` ranges of ``fd`` within ``[start, end)`` that hold data."""
    out: list[tuple[int, int]] = []
    at = start
    while at < end:
        try:
            lo = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past ``at``
            break
        hi = min(end, os.lseek(fd, lo, os.SEEK_HOLE))
        lo -= lo % mmap.PAGESIZE
        if lo < hi:
            out.append((lo, hi))
        at = hi
    return out
