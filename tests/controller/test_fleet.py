"""A controller and two engine instances in separate processes, sharing one Redis.

The controller's answers are checked against what the instances really hold and serve: every
command is followed by requests whose tokens and hit counters show its effect.
"""

from __future__ import annotations

import pytest

from kvlayer.controller.client import AdminClient, best_instance
from tests.controller.fleet import UP, C, prompt, really_holds, running_fleet, settled
from tests.controller.harness import wait_until


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    with running_fleet(tmp_path_factory.mktemp("fleet"), tiny_model_dir) as f:
        yield f


def test_lookup_matches_what_each_instance_holds(fleet):
    a, b = fleet.instances["a"], fleet.instances["b"]
    pa, pb = prompt(1), prompt(2)
    a.generate(pa)
    b.generate(pb)
    fleet.admin.evict("b", pb, tier="redis")  # b alone holds pb now
    assert settled(fleet, pa) == {"a": (80, {"cpu": 80, "nvme": 80, "redis": 80}),
                                  "b": (80, {"cpu": 0, "nvme": 0, "redis": 80})}
    assert settled(fleet, pb) == {"a": (0, {"cpu": 0, "nvme": 0, "redis": 0}),
                                  "b": (80, {"cpu": 80, "nvme": 80, "redis": 0})}
    assert settled(fleet, pa[: 2 * C] + prompt(3, 3 * C))["a"] == (32, {"cpu": 32, "nvme": 32, "redis": 32})
    assert settled(fleet, prompt(4)) == {n: (0, {"cpu": 0, "nvme": 0, "redis": 0}) for n in "ab"}
    # KV-aware routing: both reach pa (b through the shared Redis), a holds it in its own tiers.
    assert best_instance(pa, fleet.model, client=fleet.admin).instance_id == "a"
    route = best_instance(pb + [7, 7], fleet.model, client=fleet.admin)
    assert (route.instance_id, route.cached_tokens) == ("b", 80)
    assert route.address == "b.test:8000", "the address the instance reported (instance_address)"


def test_a_pinned_prefix_survives_a_workload_that_evicts_everything_else(fleet):
    a = fleet.instances["a"]
    kept, other = prompt(10), prompt(11)
    first = a.generate(kept)
    a.generate(other)
    assert fleet.admin.pin("a", kept, tier="cpu").results[0].chunks == 5
    evictions = fleet.admin.stats("a").instances[0]
    for seed in range(100, 112):  # 60 chunks through a CPU tier of 24
        a.generate(prompt(seed))
    assert settled(fleet, kept)["a"][1]["cpu"] == 80
    assert settled(fleet, other)["a"][1]["cpu"] == 0
    cpu = lambda s: next(t for t in s.tiers if t.tier == "cpu")
    wait_until(lambda: cpu(fleet.admin.stats("a").instances[0]).evictions > cpu(evictions).evictions,
               what="the heartbeat to report evictions")
    fleet.admin.unpin("a", kept, tier="cpu")
    before = a.hit_tokens()
    again = a.generate(kept)
    assert again["tokens"] == first["tokens"] and again["external"] == 79
    assert a.hit_tokens()["cpu"] - before["cpu"] > 0


def test_evict_makes_the_next_request_recompute(fleet):
    a = fleet.instances["a"]
    p = prompt(20)
    first = a.generate(p)
    hit = a.generate(p)
    assert first["external"] == 0 and hit["external"] == 79 and hit["tokens"] == first["tokens"]
    result = fleet.admin.evict("a", p).results[0]
    assert result.ok and result.chunks == 15  # 5 chunks in each of cpu, nvme and redis
    assert fleet.holds_per_instance(p) == really_holds(fleet, p) == {
        "a": (0, {"cpu": 0, "nvme": 0, "redis": 0}), "b": (0, {"cpu": 0, "nvme": 0, "redis": 0})}
    before = a.hit_tokens()
    again = a.generate(p)
    assert again["external"] == 0 and again["tokens"] == first["tokens"]
    assert a.hit_tokens() == before, "nothing may come from the tiers: the prefix was recomputed"


def test_move_from_cpu_to_nvme_and_back_keeps_tokens_identical(fleet):
    a = fleet.instances["a"]
    p = prompt(30)
    first = a.generate(p)
    fleet.admin.evict("a", p, tier="nvme")
    fleet.admin.evict("a", p, tier="redis")
    assert a.holds(p)["tiers"] == {"cpu": 80, "nvme": 0, "redis": 0}

    moved = fleet.admin.move("a", p, src_tier="cpu", dst_tier="nvme").results[0]
    assert (moved.chunks, moved.tokens) == (5, 80)
    assert a.holds(p)["tiers"] == fleet.holds_per_instance(p)["a"][1] == {"cpu": 0, "nvme": 80, "redis": 0}
    before = a.hit_tokens()
    from_disk = a.generate(p)
    assert from_disk["tokens"] == first["tokens"] and from_disk["external"] == 79
    after = a.hit_tokens()
    assert after["nvme"] > before["nvme"] and after["cpu"] == before["cpu"]

    fleet.admin.move("a", p, src_tier="nvme", dst_tier="cpu")
    assert a.holds(p)["tiers"] == fleet.holds_per_instance(p)["a"][1] == {"cpu": 80, "nvme": 0, "redis": 0}
    from_cpu = a.generate(p)
    assert from_cpu["tokens"] == first["tokens"] and from_cpu["external"] == 79
    assert a.hit_tokens()["cpu"] > after["cpu"] and a.hit_tokens()["nvme"] == after["nvme"]


def test_move_to_another_instance_through_redis_makes_it_hit(fleet):
    a, b = fleet.instances["a"], fleet.instances["b"]
    p = prompt(40)
    first = a.generate(p)
    fleet.admin.evict("a", p, tier="redis")
    assert fleet.holds_per_instance(p)["b"] == (0, {"cpu": 0, "nvme": 0, "redis": 0})

    steps = fleet.admin.move("a", p, dst_instance_id="b", dst_tier="cpu").results
    assert [(s.instance_id, s.tokens) for s in steps] == [("a", 80), ("b", 80), ("a", 80)]  # push, pull, drop
    assert really_holds(fleet, p) == fleet.holds_per_instance(p) == {
        "a": (80, {"cpu": 0, "nvme": 0, "redis": 80}), "b": (80, {"cpu": 80, "nvme": 0, "redis": 80})}
    before = b.hit_tokens()
    on_b = b.generate(p)
    assert on_b["external"] == 79 and on_b["tokens"] == first["tokens"]
    assert b.hit_tokens()["cpu"] > before["cpu"] and b.hit_tokens()["redis"] == before["redis"]


def test_prefill_on_one_instance_decode_on_another(fleet):
    a, b = fleet.instances["a"], fleet.instances["b"]
    p = prompt(50)
    alone = a.generate(p, max_tokens=8, salt="reference")  # a salt shares nothing: all computed here
    assert alone["external"] == 0
    assert a.generate(p, max_tokens=1)["external"] == 0  # prefill: the prompt's KV goes to Redis
    wait_until(lambda: fleet.holds_per_instance(p)["b"] == (80, {"cpu": 0, "nvme": 0, "redis": 80}),
               what="a's admission events")  # events travel on their own, every 50 ms
    assert best_instance(p, fleet.model, client=fleet.admin).instance_id == "a"
    before = b.hit_tokens()
    decoded = b.generate(p, max_tokens=8)
    assert decoded["external"] == 79 and decoded["tokens"] == alone["tokens"]
    assert b.hit_tokens()["redis"] > before["redis"]


def test_admin_refusals_over_the_wire(fleet):
    for token in (None, "wrong"):
        with AdminClient(fleet.controller.address, token=token) as bad:
            with pytest.raises(Exception) as e:
                bad.list_instances()
            assert e.value.code == "UNAUTHENTICATED"
    with pytest.raises(Exception) as e:
        fleet.admin.pin("nobody", prompt(1))
    assert e.value.code == "NOT_FOUND"
    assert {i.instance_id: i.state for i in fleet.admin.list_instances().instances} == {"a": UP, "b": UP}
