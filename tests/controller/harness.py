"""Helpers for the controller tests: a controller in a background thread, in-process engines
with an agent, raw instance streams, and polling.

``ServerThread`` runs ``ControllerServer`` on its own event loop in a daemon thread (port 0:
a free port), so a test talks to it through real gRPC without a subprocess.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.agent import ControllerAgent
from kvlayer.controller.server import ControllerServer
from kvlayer.controller.settings import ControllerSettings
from kvlayer.layout import KVLayout

T = TypeVar("T")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)
CHUNK = 4
"""Tokens per chunk of the in-process instances' KVCacheEngines (a chunk of ``LAYOUT`` is 512 bytes)."""
MODEL = "tiny-test-model"


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class ServerThread:
    """A ``ControllerServer`` on its own loop and thread; ``address`` once started."""

    def __init__(self, **settings: Any) -> None:
        settings.setdefault("listen", "127.0.0.1:0")
        settings.setdefault("heartbeat_interval_s", 0.2)
        settings.setdefault("heartbeat_timeout_s", 5.0)  # generous: the test machine may be loaded
        self.settings = ControllerSettings(**settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: ControllerServer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the server's loop (a coroutine function or a plain one) and return its result."""
        async def run() -> Any:
            value = fn()
            return await value if asyncio.iscoroutine(value) else value

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def start(self) -> ServerThread:
        """Start the loop's thread and the server on it; ``port`` is then the bound port."""
        self.thread.start()
        self.server = ControllerServer(self.settings)
        self.port = self.call(self.server.start)
        return self

    def stop(self) -> None:
        """Stop the server gracefully and end the thread (idempotent)."""
        if not self.thread.is_alive():
            return
        server, self.server = self.server, None
        if server is not None:
            self.call(lambda: server.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_kv(instance_id: str, cpu_chunks: int = 64, model_name: str = MODEL, **config: Any) -> KVCacheEngine:
    """A model-less ``KVCacheEngine`` of ``model_name`` (CPU tier of ``cpu_chunks`` chunks; ``config``
    adds or overrides kvlayer settings)."""
    cfg = {"chunk_size": CHUNK, "cpu_capacity": cpu_chunks * LAYOUT.chunk_bytes(CHUNK),
           "staging_capacity": 64 * LAYOUT.chunk_bytes(CHUNK), "instance_id": instance_id, **config}
    return KVCacheEngine(cfg, LAYOUT, model_name=model_name, model_fingerprint="fp-0")


def store_tokens(kv: KVCacheEngine, token_ids: list[int]) -> None:
    """Store ``token_ids``' chunks with deterministic KV (one paged cache block per token)."""
    n = len(token_ids)
    caches = [torch.randn(2, n, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=torch.Generator().manual_seed(i))
              for i in range(LAYOUT.num_layers)]
    kv.store(token_ids, caches, torch.arange(n))
    kv.flush()


def connect(kv: KVCacheEngine, address: str, token: str | None = None) -> ControllerAgent:
    """A started agent linking ``engine`` to the controller at ``address`` (fast backoff for tests)."""
    agent = ControllerAgent(kv, address, token, backoff_s=(0.05, 0.5))
    agent.start()
    return agent


def raw_instance(address: str, instance_id: str, mute: threading.Event, end: threading.Event,
                 tiers: tuple[pb.TierInfo, ...] = (pb.TierInfo(name="cpu", rank=10),),
                 beat: pb.Heartbeat | None = None, role: str = "") -> tuple[grpc.Channel, Any]:
    """A raw instance stream (no engine): it registers ``tiers`` (and ``role``; "" as an instance
    older than roles sends), snapshots one chunk, sends
    ``beat`` (an empty heartbeat by default) every 50 ms until ``mute`` is set, then sends
    nothing more; it half-closes once ``end`` is set. It never answers a command. Returns the
    channel and the call (iterate it for the controller's messages; ``cancel()`` drops it)."""
    channel = grpc.insecure_channel(address)
    ns = pb.ModelNamespace(model_name=MODEL, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4,
                           chunk_size=4, tp_size=1, format_version=1)

    def messages() -> Any:
        yield pb.InstanceMessage(register=pb.Register(instance_id=instance_id, namespace=ns, tiers=tiers, role=role))
        yield pb.InstanceMessage(snapshot=pb.SnapshotPart(tier=tiers[0].name, digests=[bytes(32)], final=True))
        while not mute.wait(0.05):
            yield pb.InstanceMessage(heartbeat=beat or pb.Heartbeat())
        end.wait()

    return channel, pb_grpc.InstanceServiceStub(channel).Connect(messages())
