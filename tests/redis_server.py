"""Throwaway ``redis-server`` processes for tests: one server, or a 3-node Redis Cluster.

``RedisServer`` runs one server on a free loopback port in a temporary folder, without
persistence (``--save "" --appendonly no``); ``stop()`` (SIGTERM), ``kill()`` (SIGKILL),
``pause()``/``resume()`` (SIGSTOP/SIGCONT) and ``restart()`` (same port, empty data) let tests
inject faults. ``RedisClusterNodes`` starts three such servers with ``--cluster-enabled yes``,
joins them with ``redis-cli --cluster create`` (no replicas) and waits for
``cluster_state:ok``. ``make_tls_files`` writes a CA and a server certificate for
``127.0.0.1`` with the ``openssl`` command. Everything calls ``pytest.skip`` when the
binaries are missing, so the suite passes on machines without Redis.

Use them as context managers::

    with RedisServer() as server:
        url = server.url
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0


def require_binary(name: str) -> str:
    """The path of the executable ``name``, or ``pytest.skip`` when it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not on PATH")
    return path


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A loopback port nobody listens on (and, with ``bus``, whose cluster bus port +10000 is free)."""
    for _ in range(200):
        port = random.randint(20_000, 50_000)
        if _port_free(port) and (not bus or _port_free(port + 10_000)):
            return port
    raise RuntimeError("no free loopback port found")


def ping(port: int, timeout_s: float = 0.5) -> bool:
    """Whether a Redis server answers on ``port`` (an error reply such as NOAUTH counts as up)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port``; ``args`` are extra server options.

    The server starts in ``start()`` (or on entering the context) and is stopped, and its
    folder deleted, on ``close()`` (or on leaving the context).
    """

    def __init__(self, args: Sequence[str] = (), port: int | None = None, tls: bool = False,
                 bus: bool = False) -> None:
        self.binary = require_binary("redis-server")
        self.args = list(args)
        self.port = port if port is not None else free_port(bus=bus)
        self.tls = tls
        self.dir = Path(tempfile.mkdtemp(prefix="kvlayer-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{HOST}:{self.port}"

    def command(self) -> list[str]:
        port_args = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        return [self.binary, *port_args, "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), *self.args]

    def start(self) -> RedisServer:
        """Start the server and wait until it answers; RuntimeError (with its log) if it does not."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.kill()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.01)
        return self

    def _answers(self) -> bool:
        if self.tls:  # a TLS port cannot answer a plaintext PING; a listening socket is enough
            with socket.socket() as s:
                return s.connect_ex((HOST, self.port)) == 0
        return ping(self.port)

    def log_tail(self, lines: int = 20) -> str:
        log = self.dir / "redis.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if self.proc is not None and self.proc.stderr is not None and self.proc.poll() is not None:
            text += self.proc.stderr.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        """Shut down gracefully (SIGTERM) and wait for the process to exit."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        self._wait()

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        self._signal(signal.SIGKILL)
        self._wait()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Start again on the same port (kills the old process if it still runs); data is gone."""
        self.kill()
        return self.start()

    def _wait(self) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "no")
"""Without full coverage required, the live nodes keep serving their slots when one dies."""


class RedisClusterNodes:
    """A Redis Cluster of ``size`` masters (no replicas) on loopback ports; ``url`` names the first."""

    def __init__(self, size: int = 3, args: Sequence[str] = ()) -> None:
        require_binary("redis-cli")
        self.nodes = [RedisServer([*CLUSTER_ARGS, *args], bus=True) for _ in range(size)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        addresses = [f"{HOST}:{n.port}" for n in self.nodes]
        subprocess.run([require_binary("redis-cli"), "--cluster", "create", *addresses,
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while not all(_cluster_ok(n.port) for n in self.nodes if n.proc and n.proc.poll() is None):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def node_of(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterNodes:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cluster_ok(port: int) -> bool:
    out = subprocess.run([require_binary("redis-cli"), "-h", HOST, "-p", str(port), "cluster", "info"],
                         capture_output=True, text=True, timeout=10)
    return "cluster_state:ok" in out.stdout


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A test CA and a server certificate (with its key) valid for ``127.0.0.1``."""

    ca_cert: Path
    cert: Path
    key: Path

    def server_args(self) -> list[str]:
        return ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca_cert), "--tls-auth-clients", "no"]


def make_tls_files(folder: Path) -> TlsFiles:
    """Write a CA and a server certificate under ``folder``; skips when ``openssl`` is missing."""
    openssl = require_binary("openssl")
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                         "server.crt"))
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=kvlayer-test-ca"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "1", "-extfile", ext],
    ]
    for step in steps:
        subprocess.run([str(a) for a in step], check=True, capture_output=True, timeout=30)
    os.chmod(key, 0o600)
    return TlsFiles(ca, cert, key)
