"""The ASGI application of ``kvlayer router``: OpenAI's routes, forwarded; its own health and metrics.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are forwarded (proxy.py);
``GET /v1/models`` lists what the up instances serve; ``GET /health`` is 200 while at least
one instance is up (503 otherwise), says whether the controller answers (``"controller":
"ok"`` or ``"unreachable"``: the router then routes by load, still healthy) and how the last
request was routed (``"routing": {"policy", "mode", "reason"}``, routing_status.py: mode
"kv" or "load", and why by load); ``GET /metrics`` is the router's series (metrics.py).
The ``/v1`` routes need the API key when keys are set. Errors are OpenAI's error JSON, as
from ``kvlayer serve``: a body that is not a JSON object 400, no such model 404, none of its
instances up 503, every instance tried failing 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvlayer.router.controller_view import ControllerView
from kvlayer.router.fleet import Fleet
from kvlayer.router.metrics import RouterMetrics
from kvlayer.router.policy import Policy
from kvlayer.router.proxy import Router
from kvlayer.serving.http import DEFAULT_MAX_BODY_BYTES, BodyLimit, check_api_key, install_error_handlers, json_object
from kvlayer.serving.metrics import CONTENT_TYPE
from kvlayer.serving.protocol import error_body


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What ``kvlayer router`` was started with (see its ``--help``)."""

    controller: str
    policy: str = "kv"
    controller_token: str | None = None
    api_keys: Sequence[str] = ()
    instance_api_key: str | None = None
    pd: bool = False
    load_cost: float = 256.0
    lookup_timeout_s: float = 0.1
    refresh_s: float = 0.5
    timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tokenizers: dict[str, Any] = field(default_factory=dict)


def build_router_app(settings: RouterSettings) -> Any:
    """The application; it connects to the controller and starts probing on start-up."""
    Policy(settings.policy, settings.load_cost)  # a bad policy fails here, before serving
    keys = [k.encode() for k in settings.api_keys]
    metrics = RouterMetrics()
    parts: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        view = ControllerView(settings.controller, settings.controller_token, settings.lookup_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        http = httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout_s, connect=5.0), limits=limits)
        headers = {"Authorization": f"Bearer {settings.instance_api_key}"} if settings.instance_api_key else {}
        fleet = Fleet(view, http, headers, settings.refresh_s)
        await fleet.refresh()
        parts["router"] = Router(fleet, view, Policy(settings.policy, settings.load_cost), metrics, settings.pd,
                                 settings.tokenizers)
        refresher = asyncio.create_task(fleet.run())
        try:
            yield
        finally:
            refresher.cancel()
            await asyncio.gather(refresher, return_exceptions=True)
            await http.aclose()
            await view.close()

    app = FastAPI(title="kvlayer router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        check_api_key(request, keys)
        return await parts["router"].forward("/v1/completions", await json_object(request))

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        check_api_key(request, keys)
        return await parts["router"].forward("/v1/chat/completions", await json_object(request))

    @app.get("/v1/models")
    async def _models(request: Request) -> Response:
        check_api_key(request, keys)
        names = parts["router"].fleet.models()
        return JSONResponse({"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                                         "owned_by": "kvlayer"} for n in names]})

    @app.get("/health")
    async def _health() -> Response:
        router = parts["router"]
        up = sorted(i.instance_id for i in router.fleet.instances.values() if i.up)
        answering = router.view.answering
        if up:
            return JSONResponse({"status": "ok", "instances": up, "controller": "ok" if answering else "unreachable",
                                 "routing": router.status.as_json(answering)})
        return JSONResponse(error_body(503, "no instance is up"), status_code=503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(parts["router"].fleet), media_type=CONTENT_TYPE)

    install_error_handlers(app, "kvlayer router")
    return BodyLimit(app, settings.max_body_bytes)
