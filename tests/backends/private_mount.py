"""Real filesystem faults for the NVMe tier's tests: a child process that sees a folder through a
mount of its own (a tiny tmpfs that fills up, a read-only bind mount), in a private mount
namespace (``unshare -m``; ``unshare -r -m`` for a non-root user), so that ENOSPC and EROFS come
from the kernel, even for root, and the machine's mounts are never touched.

Used by ``test_disk_full.py`` and ``test_nvme_faults.py``; the child runs a function of a test
module and prints what it returns as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvlayer.backends import nvme_files
from tests.backends.test_nvme import ROOT

READ_ONLY = 'mount --bind "$DIR" "$DIR" && mount -o remount,bind,ro "$DIR" "$DIR"'
"""A read-only bind mount of the folder over itself."""


def tmpfs(size: str, inodes: int | None = None) -> str:
    """A tmpfs of ``size`` bytes (``mount``'s syntax: ``256k``) and at most ``inodes`` inodes
    (the root folder is one) over the folder."""
    limit = f",nr_inodes={inodes}" if inodes is not None else ""
    return f'mount -t tmpfs -o size={size}{limit},mode=0755 kvlayer-test "$DIR"'


def run_with_mount(folder: Path, mount: str, module: str, function: str, *args: str, timeout: float = 120) -> Any:
    """What ``module.function(str(folder), *args)`` returns (JSON), run by a Python child that
    sees ``folder`` after the shell commands ``mount`` (``$DIR`` is the folder) in a private
    mount namespace. Skips the test where such a namespace cannot be made; AssertionError (with
    the child's stderr) if the child fails."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is missing: no private mount namespace for a real full or read-only disk")
    prefix = [unshare, "-m"] if os.geteuid() == 0 else [unshare, "-r", "-m"]  # -r: a user namespace
    script = f'DIR="$1"; shift; {mount} && exec "$@"'
    probe = subprocess.run([*prefix, "sh", "-c", script, "sh", str(folder), "true"], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private mount namespace ({' '.join(prefix)}): {probe.stderr.strip()}")
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); from {module} import {function}; "
            f"print(json.dumps({function}(*sys.argv[1:])))")
    out = subprocess.run([*prefix, "sh", "-c", script, "sh", str(folder), sys.executable, "-c", code,
                          str(folder), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CALLS = {"makedirs": "mkdir", "_preallocate": "fallocate", "write_parts": "write"}
"""The call a write failed in, by the innermost function of its traceback (``write_temp``'s own
calls by their line)."""


@dataclass
class WriteFailures:
    """What the chunk writes of a child met (``record_write_failures``)."""

    calls: list[tuple[int, str]] = field(default_factory=list)
    """``(errno, call)`` of each OSError, ``call`` one of ``mkdir``, ``open``, ``fallocate``,
    ``write``, ``fsync``."""
    bytes_written: list[int] = field(default_factory=list)
    """The temporary file's size each time a ``write`` failed."""

    def clear(self) -> None:
        self.calls.clear()
        self.bytes_written.clear()


def record_write_failures() -> WriteFailures:
    """In a child only (it wraps ``nvme_files.write_temp`` and ``write_parts`` for good): what the
    chunks' writes raise from now on. The writes themselves are the real ones."""
    seen = WriteFailures()
    real_temp: Callable[..., str] = nvme_files.write_temp
    real_parts: Callable[[int, Any], None] = nvme_files.write_parts

    def write_temp(*args: Any) -> str:
        try:
            return real_temp(*args)
        except OSError as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            line = frame.line or ""
            call = CALLS.get(frame.name) or ("open" if "os.open" in line else "fsync" if "fsync" in line else line)
            seen.calls.append((e.errno or 0, call))
            raise

    def write_parts(fd: int, parts: Any) -> None:
        try:
            real_parts(fd, parts)
        except OSError:
            seen.bytes_written.append(os.fstat(fd).st_size)
            raise

    nvme_files.write_temp = write_temp  # type: ignore[assignment]
    nvme_files.write_parts = write_parts  # type: ignore[assignment]
    return seen


def free_bytes(folder: str | Path) -> int:
    """The bytes still free on ``folder``'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill_up(path: Path) -> int:
    """Write zeros to ``path`` until the filesystem is full; the bytes written."""
    with open(path, "ab", buffering=0) as f:
        for piece in (1 << 16, 1 << 12):
            try:
                while True:
                    f.write(b"\0" * piece)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        return f.tell()


def use_up_inodes(folder: Path) -> int:
    """Create empty files in ``folder`` until the filesystem has no inode left; how many."""
    n = 0
    while True:
        try:
            (folder / f"inode-{n}").touch()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            return n
        n += 1
