"""A fleet of real processes on loopback: a controller, ``kvlayer serve`` instances and a router."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvlayer.controller.client import AdminClient
from tests.controller.fleet import ControllerProcess
from tests.controller.harness import wait_until
from tests.serve_process import RouterProcess, ServeProcess

CHUNK = 16


def kv_config(folder: Path, **extra: object) -> str:
    path = folder / f"kv-{random.randrange(10**9)}.yaml"
    keys = {"cpu_capacity": "32MiB", "chunk_size": CHUNK, **extra}
    path.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()), encoding="utf-8")
    return str(path)


def instance(model: str, folder: Path, controller: str, name: str, *args: str, **kv: object) -> ServeProcess:
    """A ``kvlayer serve`` that joins ``controller`` as instance ``name`` (one torch thread)."""
    env = {"KVLAYER_CONTROLLER_URL": controller, "KVLAYER_INSTANCE_ID": name}
    return ServeProcess(model, "--kv-config", kv_config(folder, **kv), "--kv-cache-memory", "64MiB",
                        "--torch-threads", "1", "--served-model-name", "tiny", *args, env=env)


@contextlib.contextmanager
def fleet(model: str, folder: Path, names: tuple[str, ...] = ("a", "b"), router_args: tuple[str, ...] = (),
          instance_args: dict[str, tuple[str, ...]] | None = None, **kv: object) -> Iterator[dict]:
    """Start a controller, the instances and a router; yields them by name ("controller",
    "router", "admin" and each instance's name)."""
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(ControllerProcess(folder, ["--heartbeat-interval", "0.2"]))
        procs = {n: instance(model, folder, controller.address, n, *(instance_args or {}).get(n, ()), **kv)
                 for n in names}
        for p in procs.values():
            stack.callback(p.kill)
        for p in procs.values():
            p.launch()  # in parallel: torch's import and the model load take seconds each
        for p in procs.values():
            p.wait_ready()
        admin = stack.enter_context(AdminClient(controller.address, timeout=10))
        wait_until(lambda: {i.instance_id for i in admin.list_instances().instances if i.state == 2} >= set(names),
                   what="every instance registered", timeout=60)
        # a generous lookup deadline: the test machine may be loaded (a test of the deadline sets its own)
        router = stack.enter_context(RouterProcess(controller.address, "--refresh-ms", "200",
                                                   "--lookup-timeout-ms", "3000", *router_args))
        wait_until(lambda: len(httpx.get(f"{router.url}/health").json().get("instances", [])) == len(names),
                   what="every instance up behind the router", timeout=30)
        yield {"controller": controller, "router": router, "admin": admin, **procs}


def random_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def complete(url: str, prompt: list[int], max_tokens: int = 4, key: str | None = None,
             **extra: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", timeout=60, headers=headers, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})


def router_metric(url: str, name: str) -> float:
    """The value of the router's Prometheus sample ``name`` (with its labels), 0 when absent."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def wait_seen_idle(router_url: str, name: str) -> None:
    """Wait until the router's last probe of instance ``name`` saw no request there: a report
    taken while a test's direct request ran would otherwise outweigh that request's prefix."""
    gauge = f'kvlayer_router_instance_load{{instance="{name}"}}'
    wait_until(lambda: router_metric(router_url, gauge) == 0, what=f"the router saw {name} idle")


def holds(admin: AdminClient, tokens: list[int], name: str) -> int:
    """Leading tokens of ``tokens`` that instance ``name``'s own tiers hold, per the controller
    (0 while it is not registered)."""
    listed = [i for i in admin.list_instances().instances if i.instance_id == name]
    if not listed:
        return 0
    for m in admin.lookup(tokens, listed[0].namespace.model_name).matches:
        if m.instance_id == name:
            return m.local_tokens
    return 0


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir
