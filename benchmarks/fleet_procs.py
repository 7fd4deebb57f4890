"""The processes of ``kvlayer bench fleet``: a controller, ``kvlayer serve`` instances and a router.

``running_fleet(plan, folder)`` starts one configuration's fleet on loopback, every process on
a port of its own choosing (port 0, read back from the line it prints): the controller, then
the instances and the router all at once (their start-ups overlap); it waits until the
router lists every instance as up, yields the router's URL, and stops everything on the way
out, whatever happened. Each child runs in its own process group and is stopped with SIGTERM
(the instances drain and flush kvlayer's writes), then SIGKILL after ``STOP_TIMEOUT_S``; on
Linux the kernel also kills it should the bench itself die first (``PR_SET_PDEATHSIG``), and
``sigterm_exits()`` turns a SIGTERM of the bench into ``SystemExit`` so the ``finally`` runs.

Each child logs (stdout and stderr) to a file in ``folder``; a start-up failure is a
``RuntimeError`` quoting that log's tail. The children get this process's environment less
every ``KVLAYER_*`` variable but ``KVLAYER_LOG_LEVEL``: an instance's kvlayer configuration is
exactly its ``--kv-config`` file plus its controller URL and instance id, so a
``KVLAYER_REDIS_URL`` in the shell cannot hand the instances a shared tier behind the bench's back.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0
"""Torch imports and model loads of several processes at once, on 2 busy cores, take a while."""
STOP_TIMEOUT_S = 20.0
LISTENING = re.compile(r"^kvlayer controller listening on (\S+)$", re.MULTILINE)
SERVE_URL = re.compile(r"^kvlayer serve: .* at (http://\S+) ", re.MULTILINE)
ROUTER_URL = re.compile(r"^kvlayer router: (http://[^,\s]+),", re.MULTILINE)
KEPT_VARIABLES = ("KVLAYER_LOG_LEVEL",)


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """One configuration: instances ``a``, ``b``, ... of ``model`` (served as ``served_name``)
    with ``roles`` (one each: both, prefill or decode), the same kvlayer ``kv`` keys each (a
    CPU tier of its own, maybe a Redis URL) and ``engine_kv_memory`` bytes of engine KV cache,
    one torch thread each; a router with ``policy`` (and ``--pd``)."""

    model: str
    roles: tuple[str, ...]
    policy: str
    pd: bool
    kv: Mapping[str, object]
    engine_kv_memory: int
    device: str = "cpu"
    served_name: str = "fleet"
    lookup_timeout_ms: float = 1000.0
    refresh_ms: float = 200.0

    def __post_init__(self) -> None:
        if not 1 <= len(self.roles) <= 26:
            raise ValueError(f"a fleet has 1..26 instances, got {len(self.roles)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(chr(ord("a") + i) for i in range(len(self.roles)))


class Child:
    """``argv`` as a child process in its own process group, logging to ``log``."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(env), start_new_session=True, preexec_fn=_die_with_parent)

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first match of ``pattern`` in the log; RuntimeError (with the log's tail) when the
        process exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = pattern.search(self.log.read_text(errors="replace"))
            if found:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start within {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Wait for the exit until ``deadline`` (monotonic), then SIGKILL its process group."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def stop_all(children: Sequence[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every child at once, then reap each (SIGKILL past ``timeout_s``)."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.reap(deadline)


@contextlib.contextmanager
def running_fleet(plan: FleetPlan, folder: Path) -> Iterator[str]:
    """Start ``plan``'s processes with logs in ``folder`` (made); yields the router's base URL
    once it lists every instance as up; stops them all on exit (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "kvlayer.cli"]
    env = child_env({})
    with contextlib.ExitStack() as stack:
        controller = Child("controller", [*cli, "controller", "--listen", "127.0.0.1:0"], folder / "controller.log",
                           env)
        stack.callback(stop_all, [controller])
        address = controller.wait_for(LISTENING, START_TIMEOUT_S).group(1)
        kv_file = folder / "kv.yaml"
        kv_file.write_text("".join(f"{k}: {v}\n" for k, v in plan.kv.items()), encoding="utf-8")
        instances: list[Child] = []
        stack.callback(stop_all, instances)
        for name, role in zip(plan.names, plan.roles):
            argv = [*cli, "serve", "--model", plan.model, "--host", "127.0.0.1", "--port", "0", "--kv-config",
                    str(kv_file), "--kv-cache-memory", str(plan.engine_kv_memory), "--torch-threads", "1",
                    "--served-model-name", plan.served_name, "--device", plan.device,
                    *(["--role", role] if role != "both" else [])]
            ids = {"KVLAYER_CONTROLLER_URL": address, "KVLAYER_INSTANCE_ID": name}
            instances.append(Child(f"instance {name}", argv, folder / f"serve-{name}.log", child_env(ids)))
        router = Child("router", [*cli, "router", "--controller", address, "--host", "127.0.0.1", "--port", "0",
                                  "--policy", plan.policy, "--refresh-ms", f"{plan.refresh_ms:g}",
                                  "--lookup-timeout-ms", f"{plan.lookup_timeout_ms:g}", *(["--pd"] if plan.pd else [])],
                       folder / "router.log", env)
        stack.callback(stop_all, [router])
        for inst in instances:
            inst.wait_for(SERVE_URL, START_TIMEOUT_S)
        url = router.wait_for(ROUTER_URL, START_TIMEOUT_S).group(1)
        wait_all_up(url, plan.names, router, START_TIMEOUT_S)
        yield url


def wait_all_up(url: str, names: Sequence[str], router: Child, timeout_s: float) -> None:
    """Until the router's ``/health`` lists every one of ``names``; RuntimeError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    up: list[str] = []
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"the router exited with {router.proc.returncode}:\n{router.tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            up = httpx.get(f"{url}/health", timeout=2.0).json().get("instances", [])
            if set(names) <= set(up):
                return
        time.sleep(0.2)
    raise RuntimeError(f"the router listed {up} of instances {list(names)} after {timeout_s:.0f} s:\n{router.tail()}")


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its ``KVLAYER_*`` variables (but ``KEPT_VARIABLES``),
    unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_") or k in KEPT_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit(143)`` (so ``finally`` blocks stop the
    children); nothing changes off the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(number: int, _frame: object) -> None:
        raise SystemExit(128 + number)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_PR_SET_PDEATHSIG = 1
_prctl = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "prctl", None) if sys.platform == "linux" else None
"""Looked up here, before any fork, so the child runs no loader code between fork and exec."""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the bench dies (Linux; elsewhere nothing)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
