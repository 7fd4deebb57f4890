"""The routing policies on hand-made instances: the kv score, its fallbacks, the baselines."""

from __future__ import annotations

import pytest

from kvlayer.router.controller_view import PrefixHit
from kvlayer.router.fleet import _LOAD, Instance
from kvlayer.router.policy import Policy


def inst(name: str, load: int = 0) -> Instance:
    return Instance(name, f"http://{name}", "m", served=("m",), up=True, others_load=load)


def ids(ranked: list[Instance]) -> list[str]:
    return [i.instance_id for i in ranked]


def test_kv_prefers_the_local_hit_until_its_load_outweighs_it():
    a, b = inst("a", load=3), inst("b")
    hits = {"a": PrefixHit(cached=2000, local=2000), "b": PrefixHit(cached=2000, local=0)}  # b: via the shared tier
    assert ids(Policy("kv", load_cost=256).rank([a, b], hits)) == ["a", "b"]  # 2000 - 768 > 0
    a.others_load = 8
    assert ids(Policy("kv", load_cost=256).rank([a, b], hits)) == ["b", "a"]  # 2000 - 2048 < 0
    assert Policy("kv", 256).score(a, hits["a"]) == 2000 - 8 * 256


def test_kv_counts_the_routers_own_open_requests_at_once():
    a, b = inst("a"), inst("b")
    hits = {"a": PrefixHit(100, 100), "b": PrefixHit(0, 0)}
    policy = Policy("kv", load_cost=60)
    assert ids(policy.rank([a, b], hits))[0] == "a"
    a.inflight = 2  # 100 - 120 < 0
    assert ids(policy.rank([a, b], hits))[0] == "b"


@pytest.mark.parametrize("hits", [None, {}, {"a": PrefixHit(0, 0)}, {"a": PrefixHit(500, 0)}])
def test_kv_without_a_local_hit_is_least_loaded(hits):
    a, b, c = inst("a", 2), inst("b", 0), inst("c", 1)
    assert ids(Policy("kv").rank([a, b, c], hits)) == ["b", "c", "a"]


def test_ties_go_in_turn():
    a, b = inst("a"), inst("b")
    policy = Policy("least-loaded")
    firsts = [ids(policy.rank([a, b]))[0] for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]


def test_round_robin_and_random():
    a, b, c = inst("a", 5), inst("b"), inst("c")
    rr = Policy("round-robin")
    assert [ids(rr.rank([a, b, c]))[0] for _ in range(4)] == ["a", "b", "c", "a"], "load plays no part"
    rnd = [ids(Policy("random", seed=1).rank([a, b, c])) for _ in range(2)]
    assert rnd[0] == rnd[1] and sorted(rnd[0]) == ["a", "b", "c"]


def test_bad_policies():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        Policy("fastest")
    with pytest.raises(ValueError, match="load_cost must be >= 0"):
        Policy("kv", load_cost=-1)
    assert Policy("kv").rank([]) == []


def test_loads_are_read_from_kvlayer_serve_and_vllm_metrics():
    text = ("kvlayer_serve_requests_running 2.0\nkvlayer_serve_requests_waiting 3.0\n"
            'vllm:num_requests_running{model_name="m"} 4.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
            "kvlayer_serve_requests_total 99\n")
    assert sum(float(v) for v in _LOAD.findall(text)) == 10.0
