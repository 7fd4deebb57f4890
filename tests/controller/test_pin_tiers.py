"""Pins and the Redis tier: Redis evicts by its own maxmemory policy and cannot pin, so a pin or
unpin naming it is refused (by the controller, and by the instance if asked directly); a pin
naming no tier pins what the tiers that can pin hold."""

from __future__ import annotations

import pytest

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.agent_commands import run_command
from kvlayer.controller.client import AdminClient, ControllerError
from tests.controller.harness import ServerThread, connect, make_kv, store_tokens, wait_until
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis
TOKENS = list(range(1, 17))
"""Four chunks."""


def test_a_pin_or_unpin_of_the_redis_tier_is_refused(tmp_path):
    with RedisServer() as redis, ServerThread() as srv, AdminClient(srv.address) as admin:
        kv = make_kv("a", nvme_path=str(tmp_path), redis_url=redis.url)
        agent = connect(kv, srv.address)
        try:
            store_tokens(kv, TOKENS)
            wait_until(lambda: agent.connected, what="registration")
            tiers = {t.name: t.cannot_pin for t in admin.list_instances().instances[0].tiers}
            assert tiers == {"cpu": False, "nvme": False, "redis": True}
            for call in (admin.pin, admin.unpin):
                with pytest.raises(ControllerError) as e:
                    call("a", TOKENS, tier="redis")
                assert e.value.code == "INVALID_ARGUMENT"
                assert "'redis'" in e.value.message and "cannot pin" in e.value.message
                assert "Redis" in e.value.message and "['cpu', 'nvme']" in e.value.message

            # The instance refuses too, when a command reaches it without the controller's check.
            for action in (pb.ACTION_PIN, pb.ACTION_UNPIN):
                reply = run_command(kv, pb.Command(command_id=7, action=action, token_ids=TOKENS, tier="redis"))
                assert (reply.command_id, reply.ok, reply.chunks) == (7, False, 0)
                assert reply.error.startswith("ValueError: tier 'redis' cannot pin")

            # No tier: the CPU and NVMe tiers pin their 4 chunks each; Redis is left to its policy.
            assert admin.pin("a", TOKENS).results[0].chunks == 8
            assert admin.evict("a", TOKENS).results[0].chunks == 4, "only Redis's copies go"
            assert kv.snapshot()["redis"] == [] and len(kv.snapshot()["cpu"]) == 4
            assert admin.unpin("a", TOKENS).results[0].chunks == 8
            assert admin.evict("a", TOKENS).results[0].chunks == 8
        finally:
            agent.close()
            kv.close()
