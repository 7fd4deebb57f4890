"""A throwaway local ``redis-server`` for benchmarks run without ``--redis-url``.

``LocalRedis`` starts the server on a free loopback port, in a temporary folder, without
persistence, and stops it (and deletes the folder) on exit. ``LocalRedis.available()`` says
whether a ``redis-server`` binary is on PATH; callers skip their Redis figures when it is not::

    with LocalRedis() as server:
        url = server.url
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0


class LocalRedis:
    """One ``redis-server`` on ``127.0.0.1:<free port>``; ``args`` are extra server options.

    Entering the context starts it and waits until it answers PING (``RuntimeError`` with its
    log if it does not within ``START_TIMEOUT_S``); leaving stops it and removes its folder.
    """

    def __init__(self, args: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not on PATH")
        self._binary = binary
        self._args = args
        self._dir = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def __enter__(self) -> LocalRedis:
        self._dir = tempfile.mkdtemp(prefix="kvlayer-bench-redis-")
        self.port = _free_port()
        log = f"{self._dir}/redis.log"
        self._proc = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--logfile", log, *self._args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = _tail(log)
                self.__exit__()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)


def _free_port() -> int:
    """A loopback port free now (the kernel's pick; a race with another process is unlikely)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False
