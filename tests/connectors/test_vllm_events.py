"""The vLLM connector's KV-cache events (kvlayer/tier_events.py, connectors/vllm_v1.py).

The tier listener and its merging run here, without vLLM; the conversion to vLLM's events and
their way through vLLM's own aggregation run in a process of their own (importing vLLM here would
swap triton for its placeholder under the Triton kernel tests' feet). vLLM's engine publishing
them is tested in test_vllm_v1.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlayer.keys import ChunkKey
from kvlayer.tier_events import Removed, Stored, TierEvents, merge_runs

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 4


def keys(name: str, n: int) -> list[ChunkKey]:
    """``n`` chunk keys of a sequence ``name`` (digests made up, chunks of ``CHUNK`` tokens)."""
    return [ChunkKey(f"{name}{i}".encode(), b"t", i * CHUNK, (i + 1) * CHUNK) for i in range(n)]


TOKENS = list(range(100, 100 + 4 * CHUNK))


class Agent:
    """Stands in for the controller agent, the tiers' other listener."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[bytes]]] = []

    def on_admit(self, tier: str, digests) -> None:
        self.calls.append(("admit", tier, list(digests)))

    def on_evict(self, tier: str, digests) -> None:
        self.calls.append(("evict", tier, list(digests)))


def test_a_remembered_chain_entering_a_tier_is_one_stored_record() -> None:
    ev = TierEvents()
    a = keys("a", 3)
    ev.remember(a, TOKENS[:12])
    ev.on_admit("cpu", [k.digest for k in a])
    assert ev.take() == [Stored("cpu", (b"a0", b"a1", b"a2"), None, tuple(TOKENS[:12]))]
    assert ev.take() == [], "taken once"


def test_remember_from_a_later_chunk_keeps_the_parent() -> None:
    ev = TierEvents()
    a = keys("a", 3)
    ev.remember(a, TOKENS[:12], first=CHUNK)
    ev.on_admit("nvme", [b"a0", b"a1", b"a2"])
    assert ev.take() == [Stored("nvme", (b"a1", b"a2"), b"a0", tuple(TOKENS[4:12]))]
    assert ev.unannounced == 1, "a0's tokens were not remembered: not announced, counted"


def test_runs_merge_only_along_a_chain_of_one_tier() -> None:
    ev = TierEvents()
    a, b = keys("a", 2), keys("b", 2)
    ev.remember(a, TOKENS[:8])
    ev.remember(b, TOKENS[8:16])
    ev.on_admit("cpu", [b"a0", b"b0", b"b1", b"a1"])
    ev.on_admit("nvme", [b"a0"])
    ev.on_admit("nvme", [b"a1"])
    ev.on_evict("cpu", [b"x"])
    ev.on_evict("cpu", [b"y", b"z"])
    ev.on_evict("nvme", [b"a0"])
    assert ev.take() == [
        Stored("cpu", (b"a0",), None, tuple(TOKENS[:4])),
        Stored("cpu", (b"b0", b"b1"), None, tuple(TOKENS[8:16])),
        Stored("cpu", (b"a1",), b"a0", tuple(TOKENS[4:8])),
        Stored("nvme", (b"a0", b"a1"), None, tuple(TOKENS[:8])),
        Removed("cpu", (b"x", b"y", b"z")),
        Removed("nvme", (b"a0",)),
    ]


def test_merge_runs_keeps_the_order_of_what_is_not_merged() -> None:
    s0 = Stored("cpu", (b"a0",), None, (1,))
    s1 = Stored("cpu", (b"a1",), b"a0", (2,))
    r = Removed("cpu", (b"a0",))
    assert merge_runs([s0, r, s1]) == [s0, r, s1]
    assert merge_runs([s0, s1]) == [Stored("cpu", (b"a0", b"a1"), None, (1, 2))]
    assert merge_runs([]) == []


def test_removals_need_no_tokens_and_every_call_reaches_the_wrapped_listener() -> None:
    agent = Agent()
    ev = TierEvents(then=agent)
    ev.on_admit("cpu", [b"never-remembered"])
    ev.on_evict("redis", [b"k"])
    assert ev.take() == [Removed("redis", (b"k",))]
    assert agent.calls == [("admit", "cpu", [b"never-remembered"]), ("evict", "redis", [b"k"])]


def test_only_the_latest_chunks_tokens_are_remembered() -> None:
    ev = TierEvents(known=2)
    a = keys("a", 3)
    ev.remember(a, TOKENS[:12])
    ev.on_admit("cpu", [b"a0", b"a1", b"a2"])
    assert ev.take() == [Stored("cpu", (b"a1", b"a2"), b"a0", tuple(TOKENS[4:12]))]
    assert ev.unannounced == 1


def test_past_the_bound_the_oldest_records_are_dropped_and_logged_once(caplog) -> None:
    ev = TierEvents(pending=2)
    with caplog.at_level(logging.DEBUG, logger="kvlayer.tier_events"):
        for d in (b"x", b"y", b"z", b"w"):
            ev.on_evict("cpu", [d])
    assert ev.take() == [Removed("cpu", (b"z", b"w"))]
    assert ev.dropped == 2
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]


def test_a_failure_while_recording_never_raises_and_still_reaches_the_agent(caplog) -> None:
    agent = Agent()
    ev = TierEvents(then=agent)
    bad = [[1, 2]]  # unhashable: the lookup of its tokens raises inside the listener
    with caplog.at_level(logging.WARNING, logger="kvlayer.tier_events"):
        ev.on_admit("cpu", bad)  # type: ignore[list-item]
        ev.remember(None, TOKENS)  # type: ignore[arg-type]
    assert ev.take() == []
    assert ev.dropped >= 1 and agent.calls == [("admit", "cpu", bad)]
    assert "recording a tier event failed" in caplog.text


# --- through vLLM (a process of its own) -------------------------------------------------------
SCRIPT = r"""
import json, os, pickle, sys
import msgspec
from vllm.config import KVEventsConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from kvlayer.tier_events import Removed, Stored
from kvlayer.connectors.vllm_v1 import KVLayerConnectorV1, KVLayerKVEvents, vllm_events

digest = bytes(range(32))
recs = [Stored("cpu", (digest, digest[::-1]), None, tuple(range(512))), Removed("nvme", (digest,))]
out = {}
stored, removed = vllm_events(recs, 256)
out["stored"] = [stored.block_hashes, stored.parent_block_hash, len(stored.token_ids), stored.block_size,
                 stored.medium, type(removed).__name__, removed.block_hashes, removed.medium]
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"  # vLLM reads it at each use
out["bytes"] = vllm_events(recs[:1], 256)[0].block_hashes
os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"

def worker(events):
    return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                             kv_connector_output=KVConnectorOutput(kv_cache_events=events))

one, two = KVLayerKVEvents([stored]), pickle.loads(pickle.dumps(KVLayerKVEvents([removed])))
merged = KVOutputAggregator(expected_finished_count=2).aggregate([worker(one), worker(two)]).kv_connector_output
events = merged.kv_cache_events
out["aggregated"] = [type(e).__name__ for e in events.aggregate().get_all_events()] + [events.get_number_of_workers()]

transfer = KVTransferConfig(kv_connector="KVLayerConnectorV1", kv_connector_module_path="kvlayer.connectors.vllm_v1",
                            kv_role="kv_both", kv_connector_extra_config={"cpu_capacity": 0, "chunk_size": 256})
config = VllmConfig(kv_transfer_config=transfer,
                    kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
sched = KVLayerConnectorV1(config, KVConnectorRole.SCHEDULER)
sched.update_connector_output(merged)
sched.update_connector_output(KVConnectorOutput(kv_cache_events=None))
taken = list(sched.take_events())
wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=taken))  # as vLLM's ZMQ publisher sends it
batch = msgspec.msgpack.Decoder(KVEventBatch).decode(wire)
out["taken"] = [[type(e).__name__, e.medium] for e in batch.events] + [list(sched.take_events())]

class Broken:
    def take_events(self):
        raise RuntimeError("boom")

sched._worker = Broken()  # the worker side's failure path: logged, the events dropped, never raised
out["broken"] = [sched.get_kv_connector_kv_cache_events(), sched.events_lost]
print(json.dumps(out, default=lambda b: b.hex()))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's CPU build is not installed")
@pytest.mark.timeout(300)
def test_vllms_events_through_vllms_aggregation_and_the_scheduler_side() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=280,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    digest = bytes(range(32))
    # vLLM's default: the low 64 bits as an int, as vLLM turns its own block hashes into event hashes
    want = [int.from_bytes(digest[-8:], "big"), int.from_bytes(digest[::-1][-8:], "big")]
    assert out["stored"] == [want, None, 512, 256, "kvlayer:cpu", "BlockRemoved", want[:1], "kvlayer:nvme"]
    assert out["bytes"] == [digest.hex(), digest[::-1].hex()], "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the digests"
    assert out["aggregated"] == ["BlockStored", "BlockRemoved", 2], "both workers' events, none dropped"
    assert out["taken"] == [["BlockStored", "kvlayer:cpu"], ["BlockRemoved", "kvlayer:nvme"], []]
    assert out["broken"] == [None, 1]
