"""Real ``kvlayer serve`` and ``kvlayer router`` processes for tests, on free loopback ports.

Use them as context managers; each starts ``python -m kvlayer.cli serve --model MODEL --port P
ARGS...`` (or ``router --controller ADDR --port P ARGS...``) in its own process group, waits
until ``GET /health`` answers 200, and on exit stops it (SIGTERM, then SIGKILL after
``STOP_TIMEOUT_S``)::

    with ServeProcess(model, "--max-num-seqs", "8") as server:
        httpx.get(f"{server.url}/v1/models")

``log()`` is what the process wrote so far (stdout and stderr together), for failure
messages. Start-up failures raise ``RuntimeError`` with that log. ``start()`` again after
``kill()`` restarts it on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from tests.redis_server import HOST, free_port

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


class ServeProcess:
    """``kvlayer serve --model model --host 127.0.0.1 --port <free> *args`` as a child process.

    ``env`` is added to this process's environment. ``url`` is the base URL (no trailing
    slash); ``returncode`` is set once it has stopped.
    """

    command = "serve"

    def __init__(self, model: str, *args: str, env: Mapping[str, str] | None = None,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.target = ["--model", model]
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="kvlayer-serve-", suffix=".log")[1])
        self.returncode: int | None = None
        self._deadline = 0.0

    def start(self) -> ServeProcess:
        """Launch it and wait until it answers ``/health``."""
        return self.launch().wait_ready()

    def launch(self) -> ServeProcess:
        """Start the process without waiting (``wait_ready`` waits): several start in parallel."""
        cmd = [sys.executable, "-m", "kvlayer.cli", self.command, *self.target, "--host", HOST,
               "--port", str(self.port), *self.args]
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        self._deadline = time.monotonic() + self.start_timeout
        return self

    def wait_ready(self) -> ServeProcess:
        assert self.proc is not None, "launch() first"
        while time.monotonic() < self._deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvlayer {self.command} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"kvlayer {self.command} did not answer /health within {self.start_timeout:.0f} s:\n"
                           f"{self.log()}")

    def log(self) -> str:
        return self._log.read_text(errors="replace")

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait for the exit (SIGKILL after ``timeout``); returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.returncode = self.proc.wait()
        return self.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.terminate()
        finally:
            self.kill()
            self._log.unlink(missing_ok=True)


class RouterProcess(ServeProcess):
    """``kvlayer router --controller controller --host 127.0.0.1 --port <free> *args``; healthy
    once at least one instance is up behind it."""

    command = "router"

    def __init__(self, controller: str, *args: str, env: Mapping[str, str] | None = None,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        super().__init__("", *args, env=env, start_timeout=start_timeout)
        self.target = ["--controller", controller]
