"""``Stats``: what the controller reports per tier is what the engine counts itself, and the
hit rate is a ratio in [0, 1]: chunks the tier answered per chunk lookups asked for."""

from __future__ import annotations

import threading

import pytest
import torch

from kvlayer.cli import main
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.client import AdminClient
from tests.controller.harness import LAYOUT, ServerThread, connect, make_kv, raw_instance, store_tokens, wait_until

HELD, OTHER, MISSING = list(range(1, 17)), list(range(30, 46)), list(range(100, 117))
FIELDS = ("used_bytes", "capacity_bytes", "lookups", "lookup_hit_chunks", "hit_tokens")


def expected_hit_rate(values: dict[str, object]) -> float:
    """The documented hit rate, from the engine's own counters."""
    asked = int(values.get("lookup_chunks", 0))
    return min(1.0, int(values["lookup_hit_chunks"]) / asked) if asked else 0.0


def test_stats_over_the_rpc_are_the_engines_own_counters(tmp_path):
    kv = make_kv("a", cpu_chunks=64, nvme_path=str(tmp_path))
    with ServerThread() as srv, AdminClient(srv.address) as admin:
        agent = connect(kv, srv.address)
        try:
            wait_until(lambda: agent.connected, what="registration")
            store_tokens(kv, HELD)
            store_tokens(kv, OTHER)
            held = [kv.lookup(t).num_tokens for t in (HELD, MISSING, HELD[:9])]
            assert held == [16, 0, 8]
            caches = [torch.zeros(2, 16, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim) for _ in range(LAYOUT.num_layers)]
            assert kv.retrieve(HELD, caches, torch.arange(16)) == 16
            kv.flush()
            own = kv.stats()["tiers"]  # the engine is idle now: its counters stay put

            def reported() -> dict[str, tuple]:
                tiers = admin.stats("a").instances[0].tiers
                return {t.tier: (*(getattr(t, f) for f in FIELDS), t.hit_rate, t.chunks) for t in tiers}

            truth = {name: (*(v[f] for f in FIELDS), expected_hit_rate(v), 8) for name, v in own.items()}
            wait_until(lambda: reported() == truth, what=f"a heartbeat with the engine's counters {truth}")
        finally:
            agent.close()
            kv.close()
    cpu = own["cpu"]
    assert (cpu["lookups"], cpu["lookup_hit_chunks"], cpu["hit_tokens"]) == (3, 6, 16), "the workload counted"
    assert (cpu["used_bytes"], cpu["capacity_bytes"]) == (8 * 512, 64 * 512)
    assert cpu["lookup_chunks"] == 10 and expected_hit_rate(cpu) == 0.6  # 6 of the 10 chunks asked for


def test_the_hit_rate_is_the_share_of_asked_chunks_a_tier_answered(capsys):
    beats = {"forty": (10, 4), "none-asked": (0, 3), "capped": (5, 7)}  # (lookup_chunks, lookup_hit_chunks)
    with ServerThread() as srv, AdminClient(srv.address) as admin:
        mute, end = threading.Event(), threading.Event()
        streams = [raw_instance(srv.address, name, mute, end, beat=pb.Heartbeat(tiers=[pb.TierStats(
                   tier="cpu", lookups=3, lookup_chunks=asked, lookup_hit_chunks=hits)]))
                   for name, (asked, hits) in beats.items()]
        try:
            rates = lambda: {s.info.instance_id: (s.tiers[0].lookup_chunks, s.tiers[0].hit_rate)
                             for s in admin.stats().instances}
            wait_until(lambda: rates() == {"forty": (10, pytest.approx(0.4)), "none-asked": (0, 0.0),
                                           "capped": (5, 1.0)}, what="the heartbeats' hit rates")
            assert main(["admin", "--controller", srv.address, "stats"]) == 0
            rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
                    if line.count("│") > 10 and "cpu" in line}
            assert "40.0%" in rows["forty"] and "100.0%" in rows["capped"]
            assert "%" not in rows["none-asked"], "no rate while no chunk was asked for"
        finally:
            mute.set()
            end.set()
            for channel, call in streams:
                call.cancel()
                channel.close()
