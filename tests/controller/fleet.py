"""Processes for the multi-process controller tests: ``kvlayer controller``, engine instances,
and ``Fleet`` (Redis, a controller and instances "a" and "b", with ``running_fleet``).

``ControllerProcess`` runs ``python -m kvlayer.cli controller`` (port 0 unless given: the port
is read from its "listening on" line). ``InstanceProcess`` runs ``tests.controller.instance_main``
(an engine with kvlayer and the controller agent) and talks to it line by line. Both log to a
file under the test's folder, quoted in every failure, and are killed by ``kill()`` whatever
state they are in; use them as context managers (or kill them in ``finally``).
"""

from __future__ import annotations

import contextlib
import json
import queue
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.client import AdminClient
from tests.controller.harness import wait_until
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
"""Torch imports and model loading on a loaded 2-core machine can take a while."""
ANSWER_TIMEOUT_S = 60.0

C = 16
"""Tokens per chunk (the engine's block size too); a chunk of the tiny model is 8 KiB."""
CPU_CHUNKS = 24
ADMIN, INSTANCE = "fleet-admin-token", "fleet-instance-token"
UP = pb.INSTANCE_STATE_UP


class _Process:
    """A child process whose stdout lines arrive in a queue (read by a thread)."""

    def __init__(self, argv: list[str], log: Path, stdin: bool = False, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log_file, env=env,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def line(self, timeout: float) -> str:
        """The next stdout line; AssertionError (with the log's tail) on exit or timeout."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            raise AssertionError(f"{self.log.name}: no answer (exit code {self.proc.poll()}):\n{self.tail()}")
        return line

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Kill the process (resuming it first if it was stopped) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log_file.close()

    def __enter__(self) -> _Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class ControllerProcess(_Process):
    """``kvlayer controller --listen 127.0.0.1:PORT ARGS`` (in ``env``, default: this process's
    environment); ``address`` once it listens."""

    def __init__(self, folder: Path, args: list[str], port: int = 0, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "kvlayer.cli", "controller", "--listen", f"127.0.0.1:{port}", *args]
        super().__init__(argv, folder / "controller.log", env=env)
        first = self.line(START_TIMEOUT_S)
        if "listening on" not in first:
            self.kill()
            raise AssertionError(f"unexpected controller output {first!r}:\n{self.tail()}")
        self.address = first.split()[-1]
        self.port = int(self.address.rsplit(":", 1)[1])

    def terminate(self) -> int:
        """SIGTERM (graceful shutdown); returns the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait()


class InstanceProcess(_Process):
    """An engine instance (``tests.controller.instance_main``) of ``model`` with ``kv_config``."""

    def __init__(self, folder: Path, name: str, model: str, kv_config: dict[str, Any]) -> None:
        argv = [sys.executable, "-m", "tests.controller.instance_main", model, json.dumps(kv_config)]
        super().__init__(argv, folder / f"instance-{name}.log", stdin=True)
        self.name = name

    def ready(self) -> InstanceProcess:
        """Wait for the engine to be up."""
        assert json.loads(self.line(START_TIMEOUT_S)) == {"ready": True}
        return self

    def ask(self, op: str, **args: Any) -> Any:
        """Send one request (see ``instance_main``) and return its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.line(ANSWER_TIMEOUT_S))
        if isinstance(answer, dict) and "error" in answer:
            raise AssertionError(f"{self.name}: {op} failed: {answer['error']}\n{self.tail()}")
        return answer

    def generate(self, prompt: list[int], max_tokens: int = 6, salt: str | None = None) -> dict[str, Any]:
        """Greedy generation: ``{"tokens": [...], "external": tokens loaded from kvlayer}``."""
        return self.ask("generate", prompt=prompt, max_tokens=max_tokens, salt=salt)

    def holds(self, prompt: list[int]) -> dict[str, Any]:
        """What the instance really holds of ``prompt``: ``{"tokens": n, "tiers": {tier: n}}``."""
        return self.ask("holds", prompt=prompt)

    def hit_tokens(self) -> dict[str, int]:
        """Per tier, the tokens loaded into the engine from it so far."""
        return {tier: values["hit_tokens"] for tier, values in self.ask("stats")["tiers"].items()}


def prompt(seed: int, n: int = 5 * C) -> list[int]:
    """``n`` random token ids of the tiny model's vocabulary (5 chunks by default)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class Fleet:
    """Redis, a controller (admin and instance tokens) and instances "a" and "b"."""

    def __init__(self, folder: Path, model_dir: str, redis_url: str, controller_args: tuple[str, ...] = ()) -> None:
        (folder / "admin.token").write_text(ADMIN + "\n")
        (folder / "instance.token").write_text(INSTANCE)
        self.folder, self.model_dir, self.redis_url = folder, model_dir, redis_url
        self.controller_args = ["--admin-token-file", str(folder / "admin.token"),
                                "--instance-token-file", str(folder / "instance.token"), *controller_args]
        self.controller = ControllerProcess(folder, self.controller_args)
        self.instances: dict[str, InstanceProcess] = {}
        self.admin = AdminClient(self.controller.address, token=ADMIN, timeout=30)
        self.model = ""
        """The model name the instances registered (the engine names a model after its folder)."""

    def wait_up(self, names: set[str], timeout: float = 30.0) -> None:
        """Until exactly ``names`` are UP (registered and snapshotted)."""
        up = lambda: {i.instance_id for i in self.admin.list_instances().instances if i.state == UP}
        wait_until(lambda: up() == names, timeout=timeout, what=f"instances {sorted(names)} up")
        self.model = self.admin.list_instances().instances[0].namespace.model_name

    def start_instance(self, name: str) -> InstanceProcess:
        """Start instance ``name`` (CPU, NVMe and the shared Redis tiers); call ``ready()`` on it."""
        config = {"chunk_size": C, "cpu_capacity": CPU_CHUNKS * 8192, "nvme_path": str(self.folder / f"nvme-{name}"),
                  "redis_url": self.redis_url, "controller_url": self.controller.address,
                  "controller_token": INSTANCE, "instance_id": name, "instance_address": f"{name}.test:8000"}
        self.instances[name] = InstanceProcess(self.folder, name, self.model_dir, config)
        return self.instances[name]

    def restart_controller(self) -> None:
        """A new controller process on the same port (the old one must be gone)."""
        self.controller.kill()
        self.controller = ControllerProcess(self.folder, self.controller_args, port=self.controller.port)

    def holds_per_instance(self, tokens: list[int]) -> dict[str, tuple[int, dict[str, int]]]:
        """What the controller says each instance holds: (cached tokens, per tier)."""
        return {m.instance_id: (m.cached_tokens, {t.tier: t.prefix_tokens for t in m.tiers})
                for m in self.admin.lookup(tokens, self.model).matches}

    def close(self) -> None:
        """Kill every process (the caller stops Redis)."""
        self.admin.close()
        for process in [*self.instances.values(), self.controller]:
            process.kill()


@contextlib.contextmanager
def running_fleet(folder: Path, model_dir: str, controller_args: tuple[str, ...] = ()) -> Iterator[Fleet]:
    """A fresh Redis, controller and instances "a" and "b" (both UP), all stopped on exit."""
    with RedisServer() as redis:
        fleet = Fleet(folder, model_dir, redis.url, controller_args)
        try:
            for name in ("a", "b"):
                fleet.start_instance(name)
            for instance in fleet.instances.values():
                instance.ready()
            fleet.wait_up({"a", "b"})
            yield fleet
        finally:
            fleet.close()


def really_holds(fleet: Fleet, tokens: list[int]) -> dict[str, tuple[int, dict[str, int]]]:
    """What each instance really holds of ``tokens``: (tokens in its tiers together, per tier)."""
    return {name: (h["tokens"], h["tiers"]) for name, h in
            ((name, i.holds(tokens)) for name, i in fleet.instances.items())}


def settled(fleet: Fleet, tokens: list[int]) -> dict[str, tuple[int, dict[str, int]]]:
    """What the instances hold of ``tokens``, once the controller says the same (admission and
    eviction events reach it within a heartbeat or so; a command's reply comes after its own)."""
    truth = really_holds(fleet, tokens)
    wait_until(lambda: fleet.holds_per_instance(tokens) == truth, what="the controller to agree")
    return truth
