"""The controller's Lookup on a hybrid sliding-window instance is the engine's own window-aware
lookup over the registry: it reports what the instance's ``retrieve`` would load, per tier and
together (docs/architecture.md section 13: one lookup)."""

from __future__ import annotations

import pytest
import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.client import AdminClient
from kvlayer.controller.wire import namespace_from_wire, namespace_to_wire
from kvlayer.layout import KVLayout
from kvlayer.windows import save_keys
from tests.controller.harness import ServerThread, connect, wait_until

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=16,
                  layer_windows=(None, 40, None, 40))
CHUNK, PROMPT, MODEL = 32, list(range(1000, 1400)), "hybrid-test"


def cached(admin: AdminClient, tokens: list[int]) -> tuple[int, dict[str, int]]:
    match, = admin.lookup(tokens, MODEL).matches
    return match.cached_tokens, {t.tier: t.prefix_tokens for t in match.tiers}


def test_lookup_on_a_hybrid_is_what_retrieve_loads_on_every_tier(tmp_path) -> None:
    config = {"chunk_size": CHUNK, "cpu_capacity": "64MiB", "nvme_path": str(tmp_path), "instance_id": "h"}
    src = [torch.randn(2, 32, 16, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    slots = torch.arange(len(PROMPT))
    with ServerThread() as server, AdminClient(server.address, timeout=10) as admin, \
            KVCacheEngine(config, LAYOUT, model_name=MODEL) as kv:
        kv.store(PROMPT, src, slots)
        assert kv.flush(10)
        agent = connect(kv, server.address)
        try:
            wait_until(lambda: agent.connected, what="registration")
            assert kv.lookup(PROMPT).num_tokens == 384
            got = wait_until(lambda: cached(admin, PROMPT)[0] and cached(admin, PROMPT), what="the snapshot")
            assert got == (384, {"cpu": 384, "nvme": 384})  # it was 0: the registry knew no layer groups

            # the window groups' objects of the first chunks are not needed for a 384-token load:
            # dropping them from the CPU tier changes neither the engine's answer nor the controller's
            early = [k for k in save_keys(LAYOUT, kv.keys(PROMPT)[:4]) if k.layers == (1, 3)]
            assert kv.remove(early, tier="cpu") == 4
            wait_until(lambda: cached(admin, PROMPT) == (384, {"cpu": 384, "nvme": 384}), what="eviction events")
            # the full group's object of chunk 3 gone from the CPU: the CPU alone holds 3 chunks' prefix,
            # but the window layers' chunks after it are there, so NVMe still gives the whole prefix
            full3 = [k for k in save_keys(LAYOUT, kv.keys(PROMPT)[3:4]) if k.layers == (0, 2)]
            assert kv.remove(full3, tier="cpu") == 1
            wait_until(lambda: cached(admin, PROMPT)[1]["cpu"] < 384, what="eviction events")
            total, per_tier = cached(admin, PROMPT)
            assert per_tier["nvme"] == 384 and total == kv.lookup(PROMPT).num_tokens == 384
            dst = [torch.zeros_like(c) for c in src]
            assert kv.retrieve(PROMPT, dst, slots) == total
        finally:
            agent.close()


def test_windows_cross_the_wire_and_bad_ones_are_refused() -> None:
    from kvlayer.keys import Namespace

    ns = Namespace(MODEL, "fp", LAYOUT, CHUNK)
    msg = namespace_to_wire(ns, False)
    assert list(msg.layer_windows) == [0, 40, 0, 40]
    assert namespace_from_wire(msg)[0].layout.layer_windows == (None, 40, None, 40)
    plain = namespace_to_wire(Namespace(MODEL, "fp", KVLayout(4, 2, 8, torch.float32, 16), CHUNK), False)
    assert list(plain.layer_windows) == [] and namespace_from_wire(plain)[0].layout.layer_windows == ()
    for bad, says in (([0, 40], "2 entries for 4 layers"), ([0, -1, 0, 0], "must be >= 0")):
        wrong = pb.ModelNamespace()
        wrong.CopyFrom(msg)
        del wrong.layer_windows[:]
        wrong.layer_windows.extend(bad)
        with pytest.raises(Exception, match=says):
            namespace_from_wire(wrong)
