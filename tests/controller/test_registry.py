"""The controller's registry on its own: snapshots, events, shared tiers, bounds, matching."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvlayer.controller.registry import InstanceSpec, Registry, RegistryFull, State, TierSpec
from kvlayer.keys import Namespace
from kvlayer.layout import KVLayout

LAYOUT = KVLayout(2, 2, 4, torch.float32, 1)
TOKENS = list(range(100, 116))  # 4 chunks of 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spec(instance_id: str, model: str = "m", shared: str = "redis-1") -> InstanceSpec:
    ns = Namespace(model, "fp", LAYOUT, 4)
    tiers = (TierSpec("cpu", 10, True), TierSpec("nvme", 20, False), TierSpec("redis", 30, False, shared))
    return InstanceSpec(instance_id, f"{instance_id}:8000", ns, False, tiers)


def digests(s: InstanceSpec, tokens: list[int] = TOKENS) -> list[bytes]:
    return [k.digest for k in s.keys(tokens, None)]


def test_snapshot_then_events_drive_the_match():
    reg = Registry()
    a = spec("a")
    entry = reg.register(a)
    assert entry.state is State.SYNCING
    d = digests(a)
    reg.admit(entry, "cpu", d[:2])
    reg.admit(entry, "nvme", d[1:3])  # chunk 2 only on nvme: together the tiers hold 3 chunks
    reg.mark_synced(entry)
    assert entry.state is State.UP
    m = reg.match(entry, a.keys(TOKENS, None))
    assert (m.cached_tokens, m.per_tier) == (12, {"cpu": 8, "nvme": 0, "redis": 0})
    reg.evict(entry, "cpu", d[:1])
    m = reg.match(entry, a.keys(TOKENS, None))
    assert (m.cached_tokens, m.per_tier["cpu"]) == (0, 0), "a prefix needs its first chunk"
    with pytest.raises(KeyError):
        reg.admit(entry, "gpu", d)


def test_a_shared_tier_is_one_pool_until_its_last_member_goes_down():
    reg = Registry()
    a, b = reg.register(spec("a")), reg.register(spec("b"))
    reg.admit(a, "redis", digests(a.spec))
    assert reg.match(b, b.spec.keys(TOKENS, None)).per_tier["redis"] == 16
    reg.mark_down(a)
    assert reg.match(b, b.spec.keys(TOKENS, None)).per_tier["redis"] == 16
    assert reg.match(a, a.spec.keys(TOKENS, None)).cached_tokens == 0, "a DOWN instance holds nothing"
    reg.mark_down(b)
    again = reg.register(spec("b"))
    assert reg.match(again, again.spec.keys(TOKENS, None)).per_tier["redis"] == 0


def test_a_match_carries_the_instances_role():
    reg = Registry()
    a = reg.register(replace(spec("a"), role="prefill"))
    b = reg.register(spec("b"))
    assert b.spec.role == "both", "the default role"
    assert [reg.match(e, e.spec.keys(TOKENS, None)).role for e in (a, b)] == ["prefill", "both"]


def test_salt_and_model_change_the_keys():
    a = spec("a")
    assert digests(a) != [k.digest for k in a.keys(TOKENS, "tenant")]
    assert digests(a) != digests(spec("x", model="other"))


def test_heartbeat_timeout_marks_down_and_forgets_later():
    clock = Clock()
    reg = Registry(clock=clock)
    entry = reg.register(spec("a"))
    reg.admit(entry, "cpu", digests(entry.spec))
    clock.now = 5.0
    assert reg.expired(10.0) == []
    clock.now = 10.5
    assert reg.expired(10.0) == [entry]
    reg.mark_down(entry)
    assert entry.state is State.DOWN and reg.chunk_count(entry, "cpu") == 0
    assert reg.live() == [] and reg.instances() == [entry]
    assert reg.forget_down(100.0) == []
    clock.now = 200.0
    assert reg.forget_down(100.0) == ["a"] and reg.instances() == []


def test_a_replaced_entry_changes_nothing():
    reg = Registry()
    old = reg.register(spec("a"))
    new = reg.register(spec("a"))
    reg.admit(old, "cpu", digests(old.spec))
    reg.mark_down(old)
    assert new.state is State.SYNCING and reg.get("a") is new
    assert reg.chunk_count(new, "cpu") == 0


def test_bounds():
    reg = Registry(max_instances=2, max_chunks_per_tier=3)
    a = reg.register(spec("a"))
    reg.register(spec("b"))
    with pytest.raises(RegistryFull):
        reg.register(spec("c"))
    reg.mark_down(a)
    reg.register(spec("c"))  # a DOWN entry makes room
    c = reg.get("c")
    with pytest.raises(RegistryFull):
        reg.admit(c, "cpu", digests(c.spec))


@pytest.mark.parametrize(("cache_layout", "quantization"), [
    ("kv-block-token-head-dim", "none"), ("blocks:vllm-cpu-avx512-x86_64", "none"),
    ("kv-block-token-head-dim", "int8"), ("blocks:vllm-cpu-avx512-x86_64", "fp8")])
def test_the_wire_namespace_gives_the_controller_the_instances_own_keys(cache_layout, quantization):
    from kvlayer.controller import controller_pb2 as pb
    from kvlayer.controller.wire import namespace_from_wire, namespace_to_wire

    layout = replace(LAYOUT, cache_layout=cache_layout)
    ns = Namespace("m", "fp", layout, 4, quantization=quantization)
    back, partial = namespace_from_wire(pb.ModelNamespace.FromString(namespace_to_wire(ns, True).SerializeToString()))
    assert partial is True
    assert back.root() == ns.root(), "the controller must compute the same keys as the instance"
    exact = Namespace("m", "fp", LAYOUT, 4)
    assert (back.root() == exact.root()) == (cache_layout == LAYOUT.cache_layout and quantization == "none")


def test_a_bad_wire_namespace_is_refused():
    import grpc

    from kvlayer.controller import controller_pb2 as pb
    from kvlayer.controller.errors import RequestError
    from kvlayer.controller.wire import namespace_from_wire, namespace_to_wire

    good = namespace_to_wire(Namespace("m", "fp", LAYOUT, 4), False)
    for field, value in (("cache_layout", "rows-of-something"), ("storage_quantization", "int4")):
        bad = pb.ModelNamespace()
        bad.CopyFrom(good)
        setattr(bad, field, value)
        with pytest.raises(RequestError, match="namespace") as info:
            namespace_from_wire(bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
