"""Fixtures of the cache-server tests: a real ``kvlayer cache-server`` process on a temporary socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlayer.cacheserver.sync_client import SyncClient

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A ``kvlayer cache-server`` subprocess; ``start`` (again after ``kill``) on the same socket."""

    def __init__(self, socket_path: str, capacity: str, token: str | None = None) -> None:
        self.socket_path = socket_path
        self.capacity = capacity
        self.token = token
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
        if self.token:
            env["KVLAYER_CACHE_SERVER_TOKEN"] = self.token
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlayer.cli", "cache-server", "--socket",
                                      self.socket_path, "--cpu-capacity", self.capacity],
                                     env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.proc.stdout.read()
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up of the socket or the arena file."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)

    def client(self) -> SyncClient:
        return SyncClient(self.socket_path, self.token)

    def wait_stats(self, ok, timeout: float = 10.0):
        """Poll the server's stats until ``ok(stats)``; the last stats (asserting ``ok``)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.client() as c:
                stats = c.stats()
            if ok(stats) or time.monotonic() > deadline:
                assert ok(stats), stats
                return stats
            time.sleep(0.05)


@pytest.fixture
def sock_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvcs-") as folder:  # short: AF_UNIX paths are at most 107 bytes
        yield os.path.join(folder, "cache.sock")


@pytest.fixture
def server(sock_path: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(sock_path, "4MiB").start()
    yield proc
    proc.stop()


@pytest.fixture
def unscrubbed(sock_path: str) -> Iterator[ServerProcess]:
    """As ``server``, but it never re-scrubs (``--scrub-mib-s 0``; commits are still sealed): a
    chunk damaged once sealed is left for the clients to find."""
    from .test_ops import FlaggedServer

    proc = FlaggedServer(sock_path, "4MiB", "--scrub-mib-s", "0").start()
    yield proc
    proc.stop()
