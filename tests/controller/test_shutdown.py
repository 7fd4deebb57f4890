"""Graceful shutdown, on ``stop()`` and on SIGTERM: the health service turns NOT_SERVING for
those watching it, and instance streams end with UNAVAILABLE, so agents reconnect elsewhere."""

from __future__ import annotations

import logging
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.controller.fleet import ControllerProcess
from tests.controller.harness import ServerThread, connect, make_kv, raw_instance, wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SHUTTING_DOWN = "the controller is shutting down"


class Watched:
    """A health watch on the whole server and a raw instance stream, both open on ``address``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.watch = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        self.mute, self.end = threading.Event(), threading.Event()
        self.instance_channel, self.stream = raw_instance(address, "raw", self.mute, self.end)

    def ready(self) -> None:
        """Both are open: the watch reported SERVING, the instance was acknowledged."""
        assert next(self.watch).status == SERVING
        assert next(self.stream).WhichOneof("body") == "registered"

    def check_shutdown(self) -> None:
        """The watch saw NOT_SERVING and the instance stream ended with UNAVAILABLE."""
        assert next(self.watch).status == NOT_SERVING
        self.watch.cancel()  # an open watch would hold the server for its whole grace period
        with pytest.raises(grpc.RpcError) as ended:
            next(self.stream)
        assert (ended.value.code(), ended.value.details()) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)

    def close(self) -> None:
        self.mute.set()
        self.end.set()
        for call in (self.watch, self.stream):
            call.cancel()
        self.channel.close()
        self.instance_channel.close()


def test_stop_turns_health_not_serving_and_ends_instance_streams(caplog):
    srv = ServerThread().start()
    kv = make_kv("a")
    agent = connect(kv, srv.address)
    watched = Watched(srv.address)
    try:
        watched.ready()
        wait_until(lambda: agent.connected, what="the agent to register")
        with caplog.at_level(logging.WARNING, logger="kvlayer.controller.agent"):
            stopping = threading.Thread(target=srv.stop)
            stopping.start()
            watched.check_shutdown()
            stopping.join(10)
            assert not stopping.is_alive()
            wait_until(lambda: f"UNAVAILABLE: {SHUTTING_DOWN}" in caplog.text, what="the agent to see UNAVAILABLE")
        assert not agent.connected
    finally:
        watched.close()
        agent.close()
        kv.close()
        srv.stop()


def test_sigterm_turns_health_not_serving_and_ends_instance_streams(tmp_path):
    with ControllerProcess(tmp_path, []) as controller:
        watched = Watched(controller.address)
        try:
            watched.ready()
            start = time.monotonic()
            controller.signal(signal.SIGTERM)
            watched.check_shutdown()
            assert controller.wait(30) == 0, controller.tail()
            assert time.monotonic() - start < 4.0, "nothing left open: no need for the 5 s grace"
        finally:
            watched.close()
        assert "shutting down" in controller.tail()
