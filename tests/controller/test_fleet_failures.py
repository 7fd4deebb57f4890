"""The fleet when a side fails: the controller restarts, an instance stalls or crashes.

Separate processes as in test_fleet.py; here heartbeats are fast (0.25 s, marked down after 3 s:
short, yet safe from a loaded machine's hiccups).
The fleet is shared: each test leaves a controller and instances "a" and "b" up.
"""

from __future__ import annotations

import signal

import pytest

from kvlayer.controller import controller_pb2 as pb
from tests.controller.fleet import Fleet, prompt, running_fleet, settled
from tests.controller.harness import wait_until


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    fast_heartbeats = ("--heartbeat-interval", "0.25", "--heartbeat-timeout", "3")
    with running_fleet(tmp_path_factory.mktemp("fleet"), tiny_model_dir, fast_heartbeats) as f:
        yield f


def states(fleet: Fleet) -> dict[str, tuple[int, int]]:
    """Per instance: (state, chunks the registry holds for it)."""
    return {i.instance_id: (i.state, i.chunks) for i in fleet.admin.list_instances().instances}


def test_controller_restart_rebuilds_the_registry_and_the_engine_serves_meanwhile(fleet):
    a = fleet.instances["a"]
    before, during = prompt(1), prompt(2)
    first = a.generate(before)
    settled(fleet, before)
    assert fleet.controller.terminate() == 0, "SIGTERM stops the controller gracefully"
    wait_until(lambda: not a.ask("agent")["connected"], what="the agent to notice")
    served = a.generate(during)  # no controller: the engine goes on
    again = a.generate(before)
    assert again["external"] == 79 and again["tokens"] == first["tokens"]

    fleet.restart_controller()
    fleet.wait_up({"a", "b"})
    assert a.ask("agent")["registrations"] == 2
    assert settled(fleet, before)["a"] == (80, {"cpu": 80, "nvme": 80, "redis": 80})
    assert settled(fleet, during)["a"][0] == 80, "chunks stored while the controller was away are in the snapshot"
    assert a.generate(during)["tokens"] == served["tokens"]


def test_a_stalled_instance_is_marked_down_and_comes_back(fleet):
    b = fleet.instances["b"]
    p = prompt(3)
    b.generate(p)
    fleet.admin.evict("b", p, tier="redis")
    assert settled(fleet, p)["b"][0] == 80
    b.signal(signal.SIGSTOP)
    wait_until(lambda: states(fleet)["b"] == (pb.INSTANCE_STATE_DOWN, 0), what="b marked down")
    assert [m.instance_id for m in fleet.admin.lookup(p, fleet.model).matches] == ["a"]
    b.signal(signal.SIGCONT)
    fleet.wait_up({"a", "b"})
    assert b.ask("agent")["registrations"] == 3  # first start, after the controller's restart, now
    assert settled(fleet, p)["b"] == (80, {"cpu": 80, "nvme": 80, "redis": 0})


def test_a_crashed_instance_leaves_the_registry_and_its_restart_resnapshots_its_disk(fleet):
    b = fleet.instances["b"]
    p = prompt(4)
    first = b.generate(p)
    fleet.admin.evict("b", p, tier="redis")
    assert settled(fleet, p)["b"][0] == 80
    b.kill()
    wait_until(lambda: states(fleet)["b"] == (pb.INSTANCE_STATE_DOWN, 0), what="b marked down")
    assert [m.instance_id for m in fleet.admin.lookup(p, fleet.model).matches] == ["a"]

    restarted = fleet.start_instance("b").ready()
    fleet.wait_up({"a", "b"})
    assert settled(fleet, p)["b"] == (80, {"cpu": 0, "nvme": 80, "redis": 0}), "the NVMe tier survived the crash"
    again = restarted.generate(p)
    assert again["external"] == 79 and again["tokens"] == first["tokens"]
