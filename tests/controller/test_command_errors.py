"""Commands that fail on an instance reach the admin caller: a tier call that raises or stalls,
a failure on one of every instance, the ``kvlayer admin`` exit code, and the commands still
waiting when an instance's stream drops."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from kvlayer.cli import main
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.client import AdminClient, ControllerError
from tests.controller.harness import ServerThread, connect, make_kv, raw_instance, store_tokens, wait_until

TOKENS = list(range(1, 17))
"""Four chunks of the harness instances."""
TIMEOUT_S = 1.0
"""The controller's command timeout here."""


def disk_on_fire(*args: object) -> int:
    """A tier call that fails."""
    raise RuntimeError("disk on fire")


def refusal(call) -> ControllerError:
    with pytest.raises(ControllerError) as e:
        call()
    return e.value


@pytest.fixture
def fleet():
    """A controller (1 s command timeout) and instances "a" and "b", each holding ``TOKENS`` on its CPU tier."""
    with ServerThread(command_timeout_s=TIMEOUT_S) as srv, AdminClient(srv.address, timeout=10) as admin:
        kvs = {name: make_kv(name) for name in ("a", "b")}
        for kv in kvs.values():
            store_tokens(kv, TOKENS)
        agents = [connect(kv, srv.address) for kv in kvs.values()]
        try:
            wait_until(lambda: all(agent.connected for agent in agents), what="registrations")
            yield srv, admin, kvs
        finally:
            for agent in agents:
                agent.close()
            for kv in kvs.values():
                kv.close()


def test_a_tier_call_that_raises_is_failed_precondition_with_its_error(fleet, monkeypatch):
    srv, admin, kvs = fleet
    monkeypatch.setattr(kvs["a"], "pin", disk_on_fire)
    e = refusal(lambda: admin.pin("a", TOKENS, tier="cpu"))
    assert e.code == "FAILED_PRECONDITION"
    assert e.message == "instance 'a': RuntimeError: disk on fire"
    monkeypatch.undo()
    assert admin.pin("a", TOKENS, tier="cpu").results[0].chunks == 4, "the instance goes on"
    assert admin.unpin("a", TOKENS, tier="cpu").results[0].chunks == 4


def test_a_stalled_tier_call_is_deadline_exceeded_and_its_late_reply_is_dropped(fleet, monkeypatch):
    srv, admin, kvs = fleet
    release = threading.Event()
    monkeypatch.setattr(kvs["a"], "unpin", lambda *args: int(release.wait(30)))
    start = time.monotonic()
    e = refusal(lambda: admin.unpin("a", TOKENS))
    assert e.code == "DEADLINE_EXCEEDED" and e.message == f"instance 'a' did not answer within {TIMEOUT_S:.1f} s"
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 5
    release.set()  # the late reply (chunks=1) must not answer the next command
    assert admin.pin("a", TOKENS, tier="cpu").results[0].chunks == 4
    assert admin.evict("a", TOKENS).results[0].chunks == 0, "pinned by the second command"


def test_a_failure_on_one_of_every_instance_is_its_result(fleet, monkeypatch, capsys):
    srv, admin, kvs = fleet
    monkeypatch.setattr(kvs["a"], "evict", disk_on_fire)
    results = {r.instance_id: r for r in admin.evict(token_ids=TOKENS).results}
    assert not results["a"].ok and results["a"].chunks == 0
    assert results["a"].error == "FAILED_PRECONDITION: instance 'a': RuntimeError: disk on fire"
    assert results["b"].ok and results["b"].chunks == 4 and results["b"].error == ""
    assert kvs["b"].lookup(TOKENS).num_tokens == 0 and kvs["a"].lookup(TOKENS).num_tokens == 16

    # The CLI prints the answer, then one line naming the failure, and exits 1.
    args = ["admin", "--controller", srv.address, "evict", "--tokens", ",".join(map(str, TOKENS))]
    assert main(args) == 1
    out = capsys.readouterr()
    assert "NO" in out.out and "disk on fire" in out.out
    assert out.err == ("kvlayer admin: failed on 1 of 2 instances: a: FAILED_PRECONDITION: instance 'a': "
                       "RuntimeError: disk on fire\n")
    assert main([*args[:3], "--json", *args[3:]]) == 1
    out = capsys.readouterr()
    assert {r["instance_id"]: r["ok"] for r in json.loads(out.out)["results"]} == {"a": False, "b": True}
    assert out.err.count("\n") == 1 and out.err.startswith("kvlayer admin: failed on 1 of 2 instances: a: ")

    release = threading.Event()
    monkeypatch.setattr(kvs["a"], "evict_all", lambda *args: int(release.wait(30)))
    try:
        results = {r.instance_id: r for r in admin.evict(all=True).results}
    finally:
        release.set()
    assert not results["a"].ok and results["a"].error.startswith("DEADLINE_EXCEEDED: instance 'a' did not answer")
    assert results["b"].ok


def test_commands_pending_when_the_stream_drops_fail_with_unavailable():
    with ServerThread(command_timeout_s=30.0) as srv, AdminClient(srv.address, timeout=30) as admin:
        mute, end = threading.Event(), threading.Event()
        channel, call = raw_instance(srv.address, "silent", mute, end)
        try:
            assert next(call).WhichOneof("body") == "registered"
            wait_until(lambda: admin.list_instances().instances[0].state == pb.INSTANCE_STATE_UP, what="up")
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                pending = [pool.submit(admin.pin, "silent", TOKENS), pool.submit(admin.evict, "silent", TOKENS)]
                commands = [next(call).command, next(call).command]  # both reached the instance, unanswered
                assert {c.action for c in commands} == {pb.ACTION_PIN, pb.ACTION_EVICT}
                start = time.monotonic()
                call.cancel()  # the instance's stream drops mid-command
                errors = [f.exception(timeout=10) for f in pending]
            assert time.monotonic() - start < 10, "not after the 30 s command timeout"
            for error in errors:
                assert isinstance(error, ControllerError) and error.code == "UNAVAILABLE"
                assert error.message.startswith("instance 'silent': ")
            wait_until(lambda: admin.list_instances().instances[0].state == pb.INSTANCE_STATE_DOWN, what="down")
            assert refusal(lambda: admin.pin("silent", TOKENS)).code == "NOT_FOUND"
        finally:
            mute.set()
            end.set()
            call.cancel()
            channel.close()
