"""An in-process engine's agent and a controller in a thread: the registry follows the engine,
commands act on it, and either side may go away without hurting the instance."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.client import AdminClient, ControllerError, best_instance
from tests.controller.harness import (
    MODEL,
    ServerThread,
    connect,
    make_kv,
    raw_instance,
    store_tokens,
    wait_until,
)


def prompt(seed: int, n: int = 17) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def cached(admin: AdminClient, tokens: list[int], instance: str, tier: str | None = None) -> int:
    """What the controller says ``instance`` caches of ``tokens`` (in ``tier``, or all tiers together)."""
    for m in admin.lookup(tokens, MODEL).matches:
        if m.instance_id == instance:
            return m.cached_tokens if tier is None else next(t.prefix_tokens for t in m.tiers if t.tier == tier)
    raise AssertionError(f"{instance} is not in the lookup")


@pytest.fixture
def server():
    with ServerThread() as srv:
        yield srv


@pytest.fixture
def admin(server):
    with AdminClient(server.address, timeout=10) as client:
        yield client


def test_snapshot_and_events_keep_lookup_equal_to_the_engine(server, admin, tmp_path):
    kv = make_kv("a", nvme_path=str(tmp_path))
    before, after = prompt(1), prompt(2)
    store_tokens(kv, before)  # in the snapshot
    agent = connect(kv, server.address)
    try:
        wait_until(lambda: agent.connected, what="registration")
        assert cached(admin, before, "a") == kv.lookup(before).num_tokens == 16
        assert cached(admin, before, "a", "nvme") == 16
        store_tokens(kv, after)  # admission events
        wait_until(lambda: cached(admin, after, "a") == 16, what="admission events")
        assert cached(admin, prompt(3), "a") == kv.lookup(prompt(3)).num_tokens == 0
        info = admin.list_instances().instances
        assert [(i.instance_id, i.state) for i in info] == [("a", pb.INSTANCE_STATE_UP)]
        assert [t.name for t in info[0].tiers] == ["cpu", "nvme"]
        stats = wait_until(lambda: [t for t in admin.stats("a").instances[0].tiers if t.put_chunks], what="heartbeat")
        assert {t.tier: (t.chunks, t.put_chunks) for t in stats} == {"cpu": (8, 8), "nvme": (8, 8)}
        assert all(t.healthy for t in stats)
    finally:
        agent.close()
        kv.close()


def test_pin_evict_and_move_act_on_the_engine_and_the_registry_at_once(server, admin, tmp_path):
    kv = make_kv("a", cpu_chunks=8, nvme_path=str(tmp_path))
    agent = connect(kv, server.address)
    kept, other = prompt(10), prompt(11)
    try:
        wait_until(lambda: agent.connected, what="registration")
        store_tokens(kv, kept)
        store_tokens(kv, other)
        assert admin.pin("a", kept, tier="cpu").results[0].chunks == 4
        for seed in range(20, 30):  # 40 chunks through a CPU tier of 8
            store_tokens(kv, prompt(seed))
        wait_until(lambda: cached(admin, other, "a", "cpu") == 0, what="eviction events")
        assert cached(admin, kept, "a", "cpu") == 16, "a pinned prefix is never evicted"
        assert admin.evict("a", kept, tier="cpu").results[0].chunks == 0, "pinned chunks stay"
        admin.unpin("a", kept, tier="cpu")

        # Replies come after the command's events: the registry is current when a call returns.
        done = admin.move("a", kept, src_tier="cpu", dst_tier="nvme").results[0]
        assert (done.chunks, done.tokens) == (4, 16)
        assert (cached(admin, kept, "a", "cpu"), cached(admin, kept, "a", "nvme")) == (0, 16)
        admin.move("a", kept, src_tier="nvme", dst_tier="cpu")
        assert (cached(admin, kept, "a", "cpu"), cached(admin, kept, "a", "nvme")) == (16, 0)
        assert kv.lookup(kept).num_tokens == 16

        assert admin.evict("a", kept).results[0].chunks == 4
        assert cached(admin, kept, "a") == kv.lookup(kept).num_tokens == 0
        result = admin.evict(all=True).results
        assert [r.instance_id for r in result] == ["a"] and result[0].ok
        assert admin.list_instances().instances[0].chunks == 0
        assert kv.snapshot() == {"cpu": [], "nvme": []}
    finally:
        agent.close()
        kv.close()


def test_lookup_ranks_instances_and_best_instance_routes(server, admin):
    a, b = make_kv("a"), make_kv("b")
    short, long_ = prompt(40, 9), prompt(40, 17)  # short is a prefix of long
    store_tokens(a, short)
    store_tokens(b, long_)
    agents = [connect(a, server.address), connect(b, server.address)]
    try:
        wait_until(lambda: all(x.connected for x in agents), what="registrations")
        ranked = admin.lookup(long_, MODEL).matches
        assert [(m.instance_id, m.cached_tokens) for m in ranked] == [("b", 16), ("a", 8)]
        assert admin.lookup(long_, MODEL, limit=1).matches[0].instance_id == "b"
        assert best_instance(long_, MODEL, address=server.address).instance_id == "b"
        assert best_instance(prompt(41), MODEL, address=server.address).instance_id == "a", "ties: lowest id"
        assert best_instance(long_, "another-model", address=server.address) is None
        with pytest.raises(ControllerError) as e:
            admin.lookup(long_, "another-model")
        assert e.value.code == "NOT_FOUND"
        with pytest.raises(ControllerError) as e:
            admin.pin("a", long_, model="another-model")
        assert e.value.code == "INVALID_ARGUMENT"
    finally:
        for agent in agents:
            agent.close()
        a.close()
        b.close()


def test_the_role_an_instance_registers_reaches_list_instances_stats_and_lookup(server, admin):
    p, d = make_kv("p", instance_role="prefill"), make_kv("d")
    tokens = prompt(45)
    store_tokens(p, tokens)
    agents = [connect(p, server.address), connect(d, server.address)]
    try:
        wait_until(lambda: all(x.connected for x in agents), what="registrations")
        assert [(i.instance_id, i.role) for i in admin.list_instances().instances] == [("d", "both"), ("p", "prefill")]
        assert [s.info.role for s in admin.stats("p").instances] == ["prefill"]
        matches = admin.lookup(tokens, MODEL).matches
        assert [(m.instance_id, m.role, m.cached_tokens) for m in matches] == [("p", "prefill", 16), ("d", "both", 0)]
    finally:
        for agent in agents:
            agent.close()
        p.close()
        d.close()


@pytest.mark.parametrize(("role", "listed"), [("", "both"), ("decode", "decode"), ("router", None)])
def test_a_registration_without_a_role_is_both_and_an_unknown_role_is_refused(server, admin, role, listed):
    mute, end = threading.Event(), threading.Event()
    channel, call = raw_instance(server.address, "raw", mute, end, role=role)
    try:
        if listed is None:
            with pytest.raises(grpc.RpcError) as refused:
                next(call)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "role" in refused.value.details() and "router" in refused.value.details()
            assert admin.list_instances().instances == []
        else:
            next(call)
            wait_until(lambda: [(i.instance_id, i.role) for i in admin.list_instances().instances] == [("raw", listed)],
                       what="registration")
    finally:
        mute.set()
        end.set()
        call.cancel()
        channel.close()


def test_controller_restart_rebuilds_the_registry_from_snapshots(admin, server):
    kv = make_kv("a")
    tokens = prompt(50)
    store_tokens(kv, tokens)
    agent = connect(kv, server.address)
    port = server.port
    try:
        wait_until(lambda: agent.connected, what="registration")
        server.stop()
        wait_until(lambda: not agent.connected, what="the agent to notice")
        store_tokens(kv, prompt(51))  # the engine goes on while the controller is away
        assert kv.lookup(prompt(51)).num_tokens == 16
        with ServerThread(listen=f"127.0.0.1:{port}") as again, AdminClient(again.address) as admin2:
            wait_until(lambda: agent.registrations == 2 and agent.connected, what="re-registration")
            wait_until(lambda: admin2.list_instances().instances[0].state == pb.INSTANCE_STATE_UP, what="up")
            assert cached(admin2, tokens, "a") == 16
            assert cached(admin2, prompt(51), "a") == 16
    finally:
        agent.close()
        kv.close()


def test_engine_serves_without_a_controller():
    kv = make_kv("lonely", controller_url="127.0.0.1:1")
    from kvlayer.controller.agent import start_agent

    agent = start_agent(kv, kv.config)
    try:
        store_tokens(kv, prompt(60))
        assert kv.lookup(prompt(60)).num_tokens == 16
        assert not agent.connected
    finally:
        agent.close()
        kv.close()
    assert start_agent(make_kv("none"), make_kv("none").config) is None


def test_an_instance_that_stops_heartbeating_is_marked_down():
    with ServerThread(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5) as srv, AdminClient(srv.address) as admin:
        mute, end = threading.Event(), threading.Event()
        channel, call = raw_instance(srv.address, "mute", mute, end)
        try:
            assert next(call).registered.heartbeat_interval_ms == 100
            state = lambda: [(i.instance_id, i.state, i.chunks) for i in admin.list_instances().instances]
            wait_until(lambda: state() == [("mute", pb.INSTANCE_STATE_UP, 1)], what="up")
            mute.set()
            wait_until(lambda: state() == [("mute", pb.INSTANCE_STATE_DOWN, 0)], what="down after the timeout")
            with pytest.raises(grpc.RpcError) as ended:
                list(call)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "heartbeat" in ended.value.details()
            with pytest.raises(ControllerError) as e:
                admin.pin("mute", [1, 2, 3, 4])
            assert e.value.code == "NOT_FOUND"
        finally:
            mute.set()
            end.set()
            call.cancel()
            channel.close()


def test_text_prefixes_use_the_models_tokenizer(tiny_model_dir):
    from kvlayer.engine.tokenizer import Tokenizer

    text = "The controller tokenizes text exactly as the instance does."
    tokens = Tokenizer.from_dir(tiny_model_dir).encode(text)
    kv = make_kv("a")
    store_tokens(kv, tokens)
    with ServerThread(tokenizers=((MODEL, tiny_model_dir),)) as srv, AdminClient(srv.address) as admin:
        agent = connect(kv, srv.address)
        try:
            wait_until(lambda: agent.connected, what="registration")
            answer = admin.lookup(text=text, model=MODEL)
            assert (answer.num_tokens, answer.matches[0].cached_tokens) == (len(tokens), len(tokens) // 4 * 4)
            assert admin.evict("a", text=text).results[0].chunks == len(tokens) // 4
            with pytest.raises(ControllerError) as e:
                admin.lookup(text=text, model="no-tokenizer-model")
            assert e.value.code == "INVALID_ARGUMENT" and "tokenizer" in e.value.message
        finally:
            agent.close()
            kv.close()


def test_a_move_through_redis_drops_only_what_the_destination_got(tmp_path):
    from tests.redis_server import RedisServer

    with RedisServer() as redis, ServerThread() as srv, AdminClient(srv.address) as admin:
        a = make_kv("a", redis_url=redis.url)
        b = make_kv("b", cpu_chunks=2, redis_url=redis.url)  # room for 2 of the 4 chunks
        agents = [connect(a, srv.address), connect(b, srv.address)]
        tokens = prompt(70, 16)
        try:
            wait_until(lambda: all(x.connected for x in agents), what="registrations")
            store_tokens(a, tokens)
            steps = admin.move("a", tokens, dst_instance_id="b", dst_tier="cpu", src_tier="cpu").results
            assert [(s.instance_id, s.tokens) for s in steps] == [("a", 16), ("b", 8), ("a", 8)]
            assert len(a.snapshot()["cpu"]) == 2, "a keeps the chunks b did not get"
            assert (cached(admin, tokens, "b", "cpu"), cached(admin, tokens, "b", "redis")) == (8, 16)
        finally:
            for agent in agents:
                agent.close()
            a.close()
            b.close()
