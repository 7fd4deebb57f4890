"""The cache server's own controller link, with real processes: a ``kvlayer controller``, a
``kvlayer cache-server --controller-url`` and an engine client (this process's ``KVCacheEngine``,
itself linked to the controller): the controller's Lookup finds what was stored through the
server, under the server's registration and, through the shared ``cache`` tier, under the client's;
an admin evict empties the server; a restarted controller gets the registrations back; a server
that stops answering is dropped after the heartbeat timeout, and the client no longer reaches
its chunks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvlayer import KVCacheEngine
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.agent import start_agent
from kvlayer.controller.client import AdminClient, ControllerError
from tests.cacheserver.worker import SEED, TOKENS, kv_caches, kv_config, layout, slots
from tests.controller.fleet import ControllerProcess
from tests.controller.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5"]
CHUNKS = len(TOKENS) // 8


def _cache_server(sock: str, controller: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvlayer.cli", "cache-server", "--socket", sock,
                             "--cpu-capacity", "4MiB", "--controller-url", controller],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert "listening on" in line, line
    return proc


def _matches(admin: AdminClient) -> dict[str, pb.InstanceMatch]:
    try:
        return {m.instance_id: m for m in admin.lookup(TOKENS, model="m").matches}
    except ControllerError as e:  # a restarted controller that no instance reached yet
        assert e.code == "NOT_FOUND", e
        return {}


def _servers(admin: AdminClient, state: int = pb.INSTANCE_STATE_UP) -> list[pb.InstanceInfo]:
    return [i for i in admin.list_instances().instances if i.role == "cache-server" and i.state == state]


def test_the_cache_server_registers_its_chunks_with_the_controller(tmp_path, sock_path):
    controller = ControllerProcess(tmp_path, HEARTBEAT)
    server = _cache_server(sock_path, controller.address)
    config = {**kv_config(sock_path), "controller_url": controller.address, "instance_id": "client-a"}
    kv = KVCacheEngine(config, layout(), model_name="m", model_fingerprint="f")
    agent = start_agent(kv, kv.config)
    admin = AdminClient(controller.address)
    try:
        assert kv.store(TOKENS, kv_caches(SEED), slots(len(TOKENS), 0)) == CHUNKS
        # The client announced its namespace: the server registers under it and reports its arena.
        [info] = wait_until(lambda: _servers(admin), what="the server's registration")
        assert info.address == sock_path and info.namespace.model_name == "m"
        assert {t.name: t.hosted for t in info.tiers} == {"cache": True}
        server_id = info.instance_id
        found = wait_until(lambda: (m := _matches(admin)).get(server_id) and m[server_id].cached_tokens and m,
                           what="the server's chunks in a lookup")
        assert found[server_id].cached_tokens == len(TOKENS)
        # The client reports no chunks of its own: it reaches the server's through the shared tier.
        client = wait_until(lambda: _matches(admin).get("client-a"), what="the client's match")
        assert (client.cached_tokens, client.local_tokens) == (len(TOKENS), 0)
        [mine] = [i for i in admin.list_instances().instances if i.instance_id == "client-a"]
        assert [t.shared_id for t in mine.tiers] == [t.shared_id for t in info.tiers]

        # The controller restarts: the server registers and snapshots again.
        assert controller.terminate() == 0
        controller.kill()
        controller = ControllerProcess(tmp_path, HEARTBEAT, port=controller.port)
        wait_until(lambda: (m := _matches(admin)).get(server_id) and m[server_id].cached_tokens == len(TOKENS),
                   what="the server's chunks after a controller restart")

        # Admin pins hold the chunks in the arena; an admin evict then removes them from the server.
        assert admin.pin(server_id, TOKENS, tier="cache").results[0].chunks == CHUNKS
        [kept] = admin.evict(server_id, TOKENS).results
        assert kept.ok and (kept.chunks, kept.skipped_pinned) == (0, CHUNKS), kept
        assert admin.unpin(server_id, TOKENS, tier="cache").results[0].chunks == CHUNKS
        [result] = admin.evict(server_id, TOKENS).results
        assert result.ok and result.chunks == CHUNKS, result
        assert _matches(admin)[server_id].cached_tokens == 0, "the registry is current when evict returns"
        assert kv.retrieve(TOKENS, kv_caches(None), slots(len(TOKENS), 20)) == 0

        # A server that stops answering is dropped after the heartbeat timeout, and its arena with it.
        assert kv.store(TOKENS, kv_caches(SEED), slots(len(TOKENS), 0)) == CHUNKS
        wait_until(lambda: _matches(admin).get("client-a", client).cached_tokens == len(TOKENS),
                   what="the client's reach after a new store")
        server.send_signal(signal.SIGSTOP)
        wait_until(lambda: _servers(admin, pb.INSTANCE_STATE_DOWN), timeout=10.0, what="the server marked down")
        assert _matches(admin)["client-a"].cached_tokens == 0, "a hosted pool goes with its host"
    finally:
        admin.close()
        if agent is not None:
            agent.close()
        kv.close()
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)
        controller.kill()

