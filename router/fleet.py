"""The instances a router may send requests to: who they are, what they serve, how loaded.

``Fleet.refresh()`` (run every ``refresh_s`` by ``run()``) takes the instances the
controller lists as up or syncing, with an HTTP address, and probes each one: ``GET /v1/models`` for the
model names it serves (once, and again after a failure) and ``GET /metrics`` for its load
(running plus waiting requests: ``kvlayer_serve_requests_*`` from ``kvlayer serve``,
``vllm:num_requests_*`` from vLLM). An instance that fails a probe, or a request
(``mark_down``), leaves the routing set at once and rejoins when a later probe answers. When
the controller is away the last list is kept, so routing goes on by load; an instance that
still answers its probes but is missing from the list (a controller just restarted, before
the instances registered again) stays for ``forget_after_s``. Requests cost no
probe: loads are read in the background, and ``inflight`` (this router's open requests on
an instance) keeps them current between probes: an instance's load is what other clients had
running or waiting at its last report, plus this router's open requests on it now.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Collection
from dataclasses import dataclass

import httpx

from kvlayer.controller import controller_pb2 as pb
from kvlayer.router.controller_view import ControllerView

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
_LIVE = (pb.INSTANCE_STATE_UP, pb.INSTANCE_STATE_SYNCING)
_LOAD = re.compile(r"^(?:kvlayer_serve_requests_(?:running|waiting)|vllm:num_requests_(?:running|waiting))"
                   r"(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


@dataclass(slots=True)
class Instance:
    """One instance: ``url`` its HTTP base URL, ``model_name`` the model its kvlayer registered
    (for lookups), ``served`` the names its ``/v1/models`` lists, ``role`` one of ``ROLES``."""

    instance_id: str
    url: str
    model_name: str
    role: str = "both"
    served: tuple[str, ...] = ()
    up: bool = False
    others_load: int = 0
    """Running plus waiting requests the instance reported, less this router's own then."""
    inflight: int = 0
    routed: int = 0
    """Requests this router sent it."""
    unlisted_since: float | None = None
    """When (``time.monotonic()``) the controller's list last began to leave it out."""

    @property
    def load(self) -> int:
        """Running plus waiting requests: those of other clients at the last report, plus this
        router's open requests now (so its own requests count at once, and only once)."""
        return self.others_load + self.inflight


class Fleet:
    """The instances (see the module docstring). ``http`` is shared with the proxy; ``headers``
    go with every probe (an instance API key)."""

    def __init__(self, view: ControllerView, http: httpx.AsyncClient, headers: dict[str, str] | None = None,
                 refresh_s: float = 0.5, probe_timeout_s: float = 2.0, forget_after_s: float = 10.0) -> None:
        self.view = view
        self.forget_after_s = forget_after_s
        self.http = http
        self.headers = headers or {}
        self.refresh_s = refresh_s
        self.probe_timeout_s = probe_timeout_s
        self.instances: dict[str, Instance] = {}

    async def run(self) -> None:
        """Refresh forever (cancel the task to stop)."""
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop routing
                log.exception("kvlayer router: refreshing the fleet failed")
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        infos = await self.view.instances()
        if infos is not None:
            self._update(infos)
        await asyncio.gather(*(self._probe(i) for i in list(self.instances.values())))

    def _update(self, infos: list[pb.InstanceInfo]) -> None:
        # A node cache server registers too (role "cache-server"), but serves no requests.
        # One that is registering again (syncing its snapshot) is alive: it stays routable.
        listed = {i.instance_id: i for i in infos
                  if i.state in _LIVE and i.address and (i.role or "both") in ROLES}
        now = time.monotonic()
        for gone in set(self.instances) - set(listed):
            inst = self.instances[gone]
            inst.unlisted_since = now if inst.unlisted_since is None else inst.unlisted_since
            if not inst.up or now - inst.unlisted_since >= self.forget_after_s:
                log.info("kvlayer router: %s left the controller's list", gone)
                del self.instances[gone]
        for iid, info in listed.items():
            url = _base_url(info.address)
            role = getattr(info, "role", "") or "both"
            known = self.instances.get(iid)
            if known is None or known.url != url:
                self.instances[iid] = Instance(iid, url, info.namespace.model_name, role)
            else:
                known.role, known.model_name, known.unlisted_since = role, info.namespace.model_name, None

    async def _probe(self, inst: Instance) -> None:
        try:
            if not inst.up or not inst.served:
                models = await self.http.get(f"{inst.url}/v1/models", headers=self.headers,
                                             timeout=self.probe_timeout_s)
                models.raise_for_status()
                inst.served = tuple(m["id"] for m in models.json()["data"])
            metrics = await self.http.get(f"{inst.url}/metrics", headers=self.headers, timeout=self.probe_timeout_s)
            metrics.raise_for_status()
            reported = int(sum(float(v) for v in _LOAD.findall(metrics.text)))
            inst.others_load = max(0, reported - inst.inflight)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            if inst.up:
                log.warning("kvlayer router: %s (%s) failed a probe: %s", inst.instance_id, inst.url,
                            type(e).__name__)
            inst.up = False
            return
        if not inst.up:
            log.info("kvlayer router: %s (%s) is up, serving %s", inst.instance_id, inst.url, list(inst.served))
        inst.up = True

    def mark_down(self, inst: Instance, why: str) -> None:
        """Take ``inst`` out of the routing set until a probe answers again."""
        if inst.up:
            log.warning("kvlayer router: %s (%s) is out of the routing set: %s", inst.instance_id, inst.url, why)
        inst.up = False

    def candidates(self, model: str, roles: Collection[str] = ROLES) -> list[Instance]:
        """The up instances serving ``model`` in one of ``roles``, by id."""
        return sorted((i for i in self.instances.values() if i.up and model in i.served and i.role in roles),
                      key=lambda i: i.instance_id)

    def knows(self, model: str) -> bool:
        """Whether any instance, up or not, serves ``model``."""
        return any(model in i.served for i in self.instances.values())

    def models(self) -> list[str]:
        return sorted({m for i in self.instances.values() if i.up for m in i.served})


def _base_url(address: str) -> str:
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"
