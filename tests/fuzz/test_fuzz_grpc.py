"""Fuzzing of the controller's gRPC services (controller/*_service.py, controller/wire.py).

Every RPC gets random fields (each right for the fleet mostly, wrong or odd about 8 times in
100) and raw bytes (random, or a real request's bytes damaged) through a generic channel call,
so the server's own parser sees garbage. A malformed request is refused with a client error
(never INTERNAL or UNKNOWN) whose detail is one line, a well-formed one is answered, and the
controller and its instances keep serving throughout. Run:
``.venv/bin/python -m pytest tests/fuzz/test_fuzz_grpc.py`` (``-m slow``: the full counts).
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.auth import bearer
from tests.controller.harness import MODEL, ServerThread, connect, make_kv, store_tokens, wait_until
from tests.fuzz.budget import budget, explore

ADMIN = "fuzz-admin-token"
MAX_TOKENS = 256
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.RESOURCE_EXHAUSTED}
KNOWN = [list(range(1, 17)), list(range(1, 9)), list(range(50, 70))]
"""Prefixes instance "a" holds (so commands built from them reach a real engine)."""

TYPED = ("LookupRequest", "PinRequest", "EvictRequest", "MoveRequest", "StatsRequest", "InstanceMessage")

# Each field is drawn right for the fleet (so requests get through) and, about ``BAD_PERCENT``
# times in 100, from a wide strategy of wrong and odd values instead.
BAD_PERCENT = 8
any_id = st.one_of(st.sampled_from(["", "nope", "a b", "x" * 200, "\x00", "ä", "../a", "b"]), st.text(max_size=12))
any_model = st.one_of(st.sampled_from(["other", "nope", "\n"]), st.text(max_size=8))
any_tier = st.one_of(st.sampled_from(["redis", "gpu", "CPU", "x" * 50, " cpu"]), st.text(max_size=6))
any_tokens = st.one_of(
    st.just([]),
    st.lists(st.integers(-3, 40), max_size=20),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
    st.integers(MAX_TOKENS - 1, MAX_TOKENS + 1).map(lambda n: list(range(1, n + 1))),  # at and past the limit
)
good_tokens = st.one_of(st.sampled_from(KNOWN), st.lists(st.integers(0, 1000), min_size=1, max_size=40))


def field(draw, good, bad):
    """A right value mostly, a wrong one about ``BAD_PERCENT`` times in 100."""
    return draw(bad) if draw(st.integers(0, 99)) >= 100 - BAD_PERCENT else draw(good)


@st.composite
def prefixes(draw) -> pb.Prefix:
    msg = pb.Prefix(token_ids=field(draw, good_tokens, any_tokens),
                    model=field(draw, st.sampled_from(["", MODEL]), any_model),
                    text=field(draw, st.just(""), st.text(max_size=20)))
    salt = field(draw, st.sampled_from([None, "tenant"]), st.text(max_size=6))
    if salt is not None:
        msg.cache_salt = salt
    return msg


@st.composite
def lookups(draw) -> pb.LookupRequest:
    request = pb.LookupRequest(prefix=draw(prefixes()), limit=field(draw, st.integers(0, 2), st.integers(-3, 3)))
    request.prefix.model = field(draw, st.just(MODEL), any_model)
    return request


def instance(draw) -> str:
    return field(draw, st.just("a"), any_id)


def tier(draw, good=("", "cpu", "nvme")) -> str:
    return field(draw, st.sampled_from(good), any_tier)


@st.composite
def pins(draw) -> pb.PinRequest:
    return pb.PinRequest(instance_id=instance(draw), prefix=draw(prefixes()), tier=tier(draw))


@st.composite
def evicts(draw) -> pb.EvictRequest:
    everything = draw(st.booleans())
    request = pb.EvictRequest(instance_id=field(draw, st.sampled_from(["a", ""]), any_id), all=everything,
                              prefix=draw(prefixes()), tier=tier(draw))
    if everything:
        request.prefix.ClearField("token_ids")
        request.prefix.text = field(draw, st.just(""), st.text(min_size=1, max_size=5))
    return request


@st.composite
def moves(draw) -> pb.MoveRequest:
    src = tier(draw, ("cpu", "nvme"))
    return pb.MoveRequest(instance_id=instance(draw), prefix=draw(prefixes()), src_tier=src,
                          dst_tier=tier(draw, ("nvme",) if src == "cpu" else ("cpu",)),
                          dst_instance_id=field(draw, st.just(""), any_id), via_tier=tier(draw, ("",)),
                          keep_source=draw(st.booleans()))


@st.composite
def stats(draw) -> pb.StatsRequest:
    return pb.StatsRequest(instance_id=field(draw, st.sampled_from(["", "a", "b"]), any_id))


tokens_md = st.sampled_from([ADMIN] * 8 + [None, "wrong"])


class Fleet:
    """The server, two registered in-process instances, and an admin stub."""

    def __init__(self, tmp: str) -> None:
        # a long heartbeat timeout: the streams must survive the fuzz, not a loaded machine's pauses
        self.server = ServerThread(admin_token=ADMIN, max_tokens=MAX_TOKENS, command_timeout_s=5.0,
                                   heartbeat_timeout_s=60.0).start()
        self.kvs = [make_kv("a", nvme_path=tmp), make_kv("b", model_name="other")]
        for t in KNOWN:
            store_tokens(self.kvs[0], t)
        self.agents = [connect(e, self.server.address) for e in self.kvs]
        self.channel = grpc.insecure_channel(self.server.address)
        self.admin = pb_grpc.AdminServiceStub(self.channel)
        self.outcomes: Counter[tuple[str, str]] = Counter()
        """(request type, "OK" or the refusal's status) -> count."""

    def close(self) -> None:
        self.channel.close()
        for agent in self.agents:
            agent.close()
        for kv in self.kvs:
            kv.close()
        self.server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(str(tmp_path_factory.mktemp("fuzz-nvme")))
    try:
        wait_until(lambda: all(a.connected for a in f.agents), what="registrations")
        yield f
        # Still serving, and the instances never lost their streams.
        assert [a.registrations for a in f.agents] == [1, 1]
        live = f.admin.ListInstances(pb.ListInstancesRequest(), metadata=bearer(ADMIN), timeout=5)
        assert {(i.instance_id, i.state) for i in live.instances if i.instance_id in "ab"} == {
            ("a", pb.INSTANCE_STATE_UP), ("b", pb.INSTANCE_STATE_UP)}
        print(f"fuzzed {sum(f.outcomes.values())} calls: {sorted(f.outcomes.items())}")
        for kind in {k for k, _ in f.outcomes if k in TYPED}:  # those that ran
            codes = {code for k, code in f.outcomes if k == kind}
            assert "OK" in codes and len(codes) >= 2, f"{kind}: the fuzz must reach both answers and refusals"
    finally:
        f.close()


def one_line(e: grpc.RpcError, empty_ok: bool = False) -> None:
    """The refusal's detail is one line (or, where ``empty_ok``, none)."""
    assert (e.details() or empty_ok) and "\n" not in (e.details() or ""), f"{e.code()}: {e.details()!r}"


def call(fleet: Fleet, method, request, token: str | None) -> object | None:
    """The answer, or None for a refusal with one of ``REFUSALS`` (anything else fails the test)."""
    kind = type(request).__name__
    try:
        answer = method(request, metadata=bearer(token), timeout=10)
    except grpc.RpcError as e:
        fleet.outcomes[kind, e.code().name] += 1
        assert e.code() in REFUSALS, f"{kind} {request} -> {e.code()}: {e.details()}"
        one_line(e)
        if token != ADMIN:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        return None
    fleet.outcomes[kind, "OK"] += 1
    assert token == ADMIN
    return answer


def check_lookup(fleet, request, token):
    answer = call(fleet, fleet.admin.Lookup, request, token)
    if answer is not None:
        assert answer.num_tokens == len(request.prefix.token_ids) > 0
        assert [m.cached_tokens for m in answer.matches] == sorted((m.cached_tokens for m in answer.matches),
                                                                  reverse=True)
        assert all(m.cached_tokens <= answer.num_tokens for m in answer.matches)


@budget(ci=500)
def test_lookup(examples, fleet):
    explore(examples, check_lookup, lookups(), tokens_md, fleet=fleet)


def check_pin_and_unpin(fleet, request, token, unpin):
    answer = call(fleet, fleet.admin.Unpin if unpin else fleet.admin.Pin, request, token)
    if answer is not None:
        assert [r.instance_id for r in answer.results] == [request.instance_id]
        assert answer.results[0].ok and answer.results[0].chunks >= 0


@budget(ci=500)
def test_pin_and_unpin(examples, fleet):
    explore(examples, check_pin_and_unpin, pins(), tokens_md, st.booleans(), fleet=fleet)


def check_evict(fleet, request, token):
    answer = call(fleet, fleet.admin.Evict, request, token)
    if answer is not None:
        assert all(r.chunks >= 0 for r in answer.results)
        if request.instance_id:
            assert [r.instance_id for r in answer.results] == [request.instance_id] and answer.results[0].ok
    if answer is not None and answer.results and request.instance_id == "a":
        for t in KNOWN:  # refill what the fuzz evicted, so later commands still find chunks
            store_tokens(fleet.kvs[0], t)


@budget(ci=400)
def test_evict(examples, fleet):
    explore(examples, check_evict, evicts(), tokens_md, fleet=fleet)


def check_move(fleet, request, token):
    answer = call(fleet, fleet.admin.Move, request, token)
    if answer is not None:
        assert all(r.ok for r in answer.results)
        assert {r.instance_id for r in answer.results} <= {request.instance_id, request.dst_instance_id}


@budget(ci=500)
def test_move(examples, fleet):
    explore(examples, check_move, moves(), tokens_md, fleet=fleet)


def check_stats_and_list_instances(fleet, request, token, listing):
    if listing:
        answer = call(fleet, fleet.admin.ListInstances, pb.ListInstancesRequest(), token)
    else:
        answer = call(fleet, fleet.admin.Stats, request, token)
        if answer is not None and request.instance_id:
            assert [s.info.instance_id for s in answer.instances] == [request.instance_id]


@budget(ci=300)
def test_stats_and_list_instances(examples, fleet):
    explore(examples, check_stats_and_list_instances, stats(), tokens_md, st.booleans(), fleet=fleet)


good_digest = st.binary(min_size=32, max_size=32)
any_digest = st.binary(max_size=40)
GOOD_NS = pb.ModelNamespace(model_name="fuzz-model", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4,
                            chunk_size=4, tp_size=1, format_version=1)


@st.composite
def namespaces(draw) -> pb.ModelNamespace:
    ns = pb.ModelNamespace()
    ns.CopyFrom(GOOD_NS)
    if draw(st.integers(0, 99)) >= 100 - 2 * BAD_PERCENT:  # one field wrong
        name, bad = draw(st.sampled_from([
            ("model_name", st.sampled_from(["", "x" * 300, "\x01"])), ("dtype", st.sampled_from(["", "int8"])),
            ("num_layers", st.integers(-1, 0)), ("head_dim", st.integers(70_000, 2**31 - 1)),
            ("chunk_size", st.integers(-(2**31), 0)), ("tp_rank", st.integers(1, 5)),
            ("format_version", st.integers(-5, 0))]))
        setattr(ns, name, draw(bad))
    return ns


@st.composite
def registers(draw) -> pb.InstanceMessage:
    names = field(draw, st.lists(st.sampled_from(["cpu", "nvme"]), min_size=1, max_size=2, unique=True),
                  st.lists(any_tier, max_size=20))
    tiers_ = [pb.TierInfo(name=n, shared_id=field(draw, st.just(""), st.sampled_from(["redis-x", "bad id"])))
              for n in names]
    return pb.InstanceMessage(register=pb.Register(
        instance_id="fuzz-" + field(draw, st.sampled_from("0123"), any_id), namespace=draw(namespaces()),
        tiers=tiers_, address=field(draw, st.just("host:1"), st.text(max_size=300))))


def digests(draw) -> list[bytes]:
    return [field(draw, good_digest, any_digest) for _ in range(draw(st.integers(0, 4)))]


@st.composite
def bodies(draw) -> pb.InstanceMessage:
    kind = draw(st.sampled_from(["snapshot", "event", "heartbeat", "reply", "other", "snapshot", "event",
                                 "heartbeat", "reply", "other", "register"]))
    t = tier(draw, ("cpu",))
    if kind == "snapshot":
        return pb.InstanceMessage(snapshot=pb.SnapshotPart(tier=t, digests=digests(draw), final=draw(st.booleans())))
    if kind == "event":
        return pb.InstanceMessage(event=pb.TierEvent(tier=t, admitted=digests(draw), evicted=digests(draw)))
    if kind == "heartbeat":
        lookups_ = field(draw, st.integers(0, 5), st.integers(-(2**63), -1))
        return pb.InstanceMessage(heartbeat=pb.Heartbeat(tiers=[pb.TierStats(tier=t, lookups=lookups_)]))
    if kind == "reply":
        return pb.InstanceMessage(reply=pb.CommandReply(command_id=draw(st.integers(0, 2**64 - 1))))
    if kind == "register":  # a second register is a protocol error
        return draw(registers())
    return field(draw, st.just(pb.InstanceMessage(heartbeat=pb.Heartbeat())), st.just(pb.InstanceMessage()))


streams = st.tuples(st.one_of(registers(), registers(), registers(), bodies()), st.lists(bodies(), max_size=6))
"""A stream opens with a register message, mostly."""
instance_tokens = st.sampled_from([None] * 9 + ["anything"])


def check_instance_stream(fleet, stream, token):
    first, rest = stream
    call_ = pb_grpc.InstanceServiceStub(fleet.channel).Connect(iter([first, *rest]), metadata=bearer(token),
                                                                timeout=10)
    try:
        answers = list(call_)
    except grpc.RpcError as e:
        fleet.outcomes["InstanceMessage", e.code().name] += 1
        assert e.code() in REFUSALS, f"{first} {rest} -> {e.code()}: {e.details()}"
        one_line(e)
        return
    fleet.outcomes["InstanceMessage", "OK"] += 1
    # Accepted: it registered, was acknowledged, then half-closed (and was marked down).
    assert first.WhichOneof("body") == "register"
    assert [a.WhichOneof("body") for a in answers] == ["registered"]


@budget(ci=400)
def test_instance_stream(examples, fleet):
    explore(examples, check_instance_stream, streams, instance_tokens, fleet=fleet)


# --- raw bytes --------------------------------------------------------------------------
UNARY = ("/kvlayer.v1.AdminService/" + m for m in
         ("Lookup", "Pin", "Unpin", "Evict", "Move", "Pins", "Stats", "ListInstances"))
METHODS = (*UNARY, "/grpc.health.v1.Health/Check", "/kvlayer.v1.InstanceService/Connect")
real_requests = st.one_of(lookups(), pins(), evicts(), moves(), stats(), registers(), bodies(),
                          st.just(health_pb2.HealthCheckRequest(service="kvlayer.v1.AdminService")))


@st.composite
def raw_messages(draw) -> bytes:
    """Random bytes, or a real request's bytes (of any method) flipped, cut, extended or overwritten."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=64))
    data = bytearray(draw(real_requests).SerializeToString())
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "cut", "extend", "overwrite"]))
        if op == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[draw(st.integers(0, len(data))):]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif data:
            at = draw(st.integers(0, len(data) - 1))
            data[at : at + 4] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


def check_raw(fleet, method, messages, token):
    """``messages`` as the request bytes of ``method`` (a stream's messages, or the first one
    alone): an answer, or a refusal that is neither INTERNAL nor UNKNOWN, in one line."""
    try:
        if method.endswith("/Connect"):
            list(fleet.channel.stream_stream(method)(iter(messages), metadata=bearer(token), timeout=10))
        else:
            fleet.channel.unary_unary(method)(messages[0], metadata=bearer(token), timeout=10)
    except grpc.RpcError as e:
        fleet.outcomes["raw", e.code().name] += 1
        assert e.code() in REFUSALS, f"{method} {messages} -> {e.code()}: {e.details()}"
        one_line(e, empty_ok=method.startswith("/grpc.health"))  # grpcio's health service: NOT_FOUND, no detail
        return
    fleet.outcomes["raw", "OK"] += 1


@budget(ci=600)
def test_raw_bytes(examples, fleet):
    explore(examples, check_raw, st.sampled_from(METHODS), st.lists(raw_messages(), min_size=1, max_size=4),
            tokens_md, fleet=fleet)
    ok = fleet.admin.Lookup(pb.LookupRequest(prefix=pb.Prefix(token_ids=KNOWN[0], model=MODEL)),
                            metadata=bearer(ADMIN), timeout=10)
    assert ok.matches and ok.matches[0].cached_tokens == len(KNOWN[0]), "the controller stopped answering"
