"""A client channel reaches a controller that comes back soon after, however long it was away."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvlayer.controller.channel import RECONNECT_BACKOFF_MS, aio_channel, parse_target


async def _serve(port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def _calls_work(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.05)
    except grpc.RpcError:
        return False
    return True


async def _recovery_after(outage_s: float) -> float:
    """Seconds of failed calls, made every 0.1 s, after a server gone ``outage_s`` is back."""
    server, port = await _serve(0)
    async with aio_channel(parse_target(f"127.0.0.1:{port}")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert await _calls_work(stub)
        await server.stop(0)
        gone = time.monotonic()
        while time.monotonic() - gone < outage_s:
            assert not await _calls_work(stub)
            await asyncio.sleep(0.1)
        server, _ = await _serve(port)
        back = time.monotonic()
        try:
            while not await _calls_work(stub):
                await asyncio.sleep(0.05)
            return time.monotonic() - back
        finally:
            await server.stop(0)


@pytest.mark.slow
def test_a_long_outage_does_not_delay_the_reconnect():
    # gRPC's own backoff had grown past 10 s by now (measured: 11.7-13.3 s of failed calls)
    waited = asyncio.run(_recovery_after(20.0))
    assert waited < RECONNECT_BACKOFF_MS[1] / 1000 * 1.2 + 1.0, f"calls failed {waited:.1f} s after the restart"
