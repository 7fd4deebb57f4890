"""The controller server: ``ControllerServer`` (grpc.aio) and ``serve`` (``kvlayer controller``).

One server hosts ``AdminService``, ``InstanceService`` and the standard
``grpc.health.v1.Health``; request bytes that do not parse are INVALID_ARGUMENT (``parsing``).
A sweeper marks instances down when their heartbeats stop (their entries leave the registry)
and forgets them later. ``serve`` runs until SIGTERM or SIGINT,
then stops gracefully: health turns NOT_SERVING, instance streams end (instances reconnect,
with backoff, to the next controller), running calls get ``grace`` seconds to finish.

Run it::

    kvlayer controller --listen 127.0.0.1:50051 --admin-token-file /etc/kvlayer/admin.token
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.admin_service import AdminServicer
from kvlayer.controller.auth import AuthInterceptor, server_credentials
from kvlayer.controller.instance_service import InstanceServicer
from kvlayer.controller.parsing import ParseInterceptor
from kvlayer.controller.registry import Clock, Registry
from kvlayer.controller.session import Session
from kvlayer.controller.settings import ControllerSettings

log = logging.getLogger(__name__)

SERVICES = ("", "kvlayer.v1.AdminService", "kvlayer.v1.InstanceService")
"""Names the health service reports on ("" is the whole server)."""
EXTRA_RPCS = 256
"""Concurrent calls allowed beyond one stream per instance."""


class ControllerServer:
    """The controller on ``settings.listen``: ``await start()`` (returns the bound port), ``await stop()``.

    Everything runs on the event loop that calls ``start``.
    """

    def __init__(self, settings: ControllerSettings, clock: Clock = time.monotonic) -> None:
        self.settings = settings
        self.registry = Registry(settings.max_instances, settings.max_chunks_per_tier, clock)
        self.sessions: dict[str, Session] = {}
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the port (useful with port 0). ``OSError`` if it cannot bind."""
        s = self.settings
        server = grpc.aio.server(
            interceptors=[AuthInterceptor(s.admin_token, s.instance_token), ParseInterceptor()],
            options=[("grpc.max_receive_message_length", s.max_message_bytes),
                     ("grpc.max_send_message_length", s.max_message_bytes),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=s.max_instances + EXTRA_RPCS)
        pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(self.registry, self.sessions, s), server)
        pb_grpc.add_InstanceServiceServicer_to_server(InstanceServicer(self.registry, self.sessions, s), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if s.tls_cert is not None and s.tls_key is not None:
                port = server.add_secure_port(s.listen, server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca))
            else:
                port = server.add_insecure_port(s.listen)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {s.listen}: {e}") from None
        if port == 0:
            raise OSError(f"cannot listen on {s.listen}")
        for name in SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server, self.port = server, port
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("kvlayer controller listening on %s (port %d, %s)", s.listen, port, "TLS" if s.tls else "plaintext")
        return port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop gracefully: NOT_SERVING, instance streams closed, calls given ``grace`` seconds (idempotent)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await self._health.enter_graceful_shutdown()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for session in list(self.sessions.values()):
            session.close("the controller is shutting down")
        await server.stop(grace)

    async def _sweep(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            for entry in self.registry.expired(timeout):
                log.warning("controller: instance %s sent nothing for %.1f s; marking it down",
                            entry.instance_id, timeout)
                session = self.sessions.get(entry.instance_id)
                if session is not None:
                    session.close(f"no heartbeat for {timeout:.1f} s")
                self.registry.mark_down(entry)
            self.registry.forget_down(self.settings.forget_down_after_s)


def serve(settings: ControllerSettings, ready: Callable[[int], None] | None = None, grace: float = 5.0) -> int:
    """Run the controller until SIGTERM or SIGINT, then stop gracefully; returns the exit status.

    ``ready(port)`` is called once it listens. ``OSError`` if it cannot bind.
    """
    return asyncio.run(_serve(settings, ready, grace))


async def _serve(settings: ControllerSettings, ready: Callable[[int], None] | None, grace: float) -> int:
    server = ControllerServer(settings)
    port = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(port)
    await stop.wait()
    log.info("kvlayer controller: shutting down")
    await server.stop(grace)
    return 0
