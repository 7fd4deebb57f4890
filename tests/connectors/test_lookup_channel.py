"""The vLLM connector's lookup channel (connectors/lookup_channel.py), without vLLM: answers cross
a real Unix socket; a dead, slow or garbled peer is a miss, never an exception or a hang."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from kvlayer.connectors import lookup_channel
from kvlayer.connectors.lookup_channel import MISS, LookupClient, LookupServer, Query, decode_request, encode_request


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "l.sock")


def test_requests_round_trip_and_answers_come_back(path) -> None:
    seen = []

    def answer(q):
        seen.append(q)
        return len(q.token_ids) - 1, (0, 1, 1)

    server = LookupServer(path, answer)
    client = LookupClient(path, timeout_s=2)
    try:
        assert client.lookup([5, 6, 2**31 - 1], "tenant-a") == (2, (0, 1, 1))
        assert client.lookup(list(range(5000)), None, request_id="r-7", start=128, limit=4096) == (4999, (0, 1, 1)), \
            "one connection, many asks"
        assert seen[0] == Query([5, 6, 2**31 - 1], "tenant-a", "", 0, 3)
        assert seen[1] == Query(list(range(5000)), None, "r-7", 128, 4096), "the request id, start and limit arrive"
        assert client.lookup([1, 2], None, limit=9) == (1, (0, 1, 1)) and seen[2].limit == 2, "limit <= tokens"
    finally:
        client.close()
        server.close()
    assert decode_request(encode_request([1, 2], "")[4:]) == Query([1, 2], None, "", 0, 2)
    with pytest.raises(ValueError, match="token ids must be"):
        encode_request([-1], None)
    with pytest.raises(ValueError, match="whole token ids"):
        decode_request(struct.pack("<HHII", 0, 0, 0, 0) + b"abc")
    with pytest.raises(ValueError, match="malformed"):
        decode_request(struct.pack("<H", 5) + b"ab")


def test_no_server_is_a_quick_miss_then_a_retry(path, monkeypatch) -> None:
    monkeypatch.setattr(lookup_channel, "RETRY_S", 0.2)
    client = LookupClient(path, timeout_s=2)
    start = time.monotonic()
    assert client.lookup([1, 2, 3], None) == MISS
    assert time.monotonic() - start < 1
    server = LookupServer(path, lambda q: (len(q.token_ids), ()))
    try:
        assert client.lookup([1, 2, 3], None) == MISS, "within the retry delay it does not ask"
        time.sleep(0.3)
        assert client.lookup([1, 2, 3], None) == (3, ())
    finally:
        server.close()
    time.sleep(0.3)
    assert client.lookup([1, 2], None) == MISS, "a server gone mid-life is a miss"


def test_a_slow_or_failing_answer_is_a_miss(path) -> None:
    release = threading.Event()

    def answer(q):
        tokens = q.token_ids
        if tokens == [9]:
            raise RuntimeError("boom")
        release.wait(5)
        return 1, (0,)

    server = LookupServer(path, answer)
    client = LookupClient(path, timeout_s=0.2)
    try:
        assert client.lookup([9], None) == MISS, "the server's own failure answers a miss"
        start = time.monotonic()
        assert client.lookup([1], None) == MISS
        assert time.monotonic() - start < 1, "bounded by the client's timeout"
    finally:
        release.set()
        server.close()


def test_a_garbled_request_closes_only_its_connection(path) -> None:
    server = LookupServer(path, lambda q: (len(q.token_ids), ()))
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(path)
        raw.sendall(struct.pack("<I", 3) + b"\x05\x00a")  # a salt longer than the request
        raw.settimeout(2)
        assert raw.recv(8) == b"", "the server hung up"
        raw.close()
        assert LookupClient(path, timeout_s=2).lookup([1, 2], None) == (2, ())
    finally:
        server.close()


def test_every_ranks_worker_is_asked_before_any_answers(tmp_path) -> None:
    """``RankedLookups`` over two real channels: each worker's answer waits until both have been
    asked (a barrier of two), which only a lookup that asks every rank at once gets past."""
    from kvlayer.connectors.vllm_scheduler import RankedLookups

    both_asked = threading.Barrier(2, timeout=5)

    def answer(found: int):
        def reply(q: Query):
            both_asked.wait()
            return found, (0,) * (found // 4)
        return reply

    servers = [LookupServer(str(tmp_path / f"r{i}.sock"), answer(n)) for i, n in enumerate((8, 4))]
    clients = [LookupClient(s.path, timeout_s=10) for s in servers]
    try:
        assert RankedLookups(clients).lookup(list(range(12)), None) == (4, ()), "the fewer tokens, no tiers"
        assert not both_asked.broken
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()
