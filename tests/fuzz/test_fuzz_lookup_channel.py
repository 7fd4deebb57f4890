"""Fuzzing of the vLLM lookup channel (connectors/lookup_channel.py) over real Unix sockets.

The server gets random frames and raw bytes: it answers each well-formed request exactly, hangs
up at the first malformed one, and keeps answering other connections. The client gets garbled
answers: a miss or the answer as sent, within its timeout, never an exception. Run:
``.venv/bin/python -m pytest tests/fuzz/test_fuzz_lookup_channel.py`` (``-m slow``: full counts).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import example
from hypothesis import strategies as st

from kvlayer.connectors.lookup_channel import (
    MAX_GROUPS,
    MAX_REQUEST_BYTES,
    MISS,
    Answer,
    LookupClient,
    LookupServer,
    Query,
    decode_request,
    encode_request,
)
from tests.fuzz.budget import budget, explore

TIMEOUT_S = 5.0
"""Longer than anything here may take: reaching it is a hang."""


def answer(q: Query) -> Answer:
    """A deterministic answer of each query, so every answer on the wire can be checked."""
    found = min(q.limit, len(q.token_ids), q.start + 3)
    return found, tuple((t + len(q.request_id)) % 3 for t in q.token_ids[: found // 2])


def answer_bytes(q: Query) -> bytes:
    found, sources = answer(q)
    return struct.pack("<II", found, len(sources)) + bytes(sources)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LookupServer]:
    s = LookupServer(str(tmp_path_factory.mktemp("lookup") / "l.sock"), answer)
    yield s
    s.close()


def one_line(e: BaseException) -> None:
    assert str(e) and "\n" not in str(e), repr(e)


# --- the request format -------------------------------------------------------------------
def check_decode(body: bytes) -> None:
    try:
        q = decode_request(body)
    except ValueError as e:
        one_line(e)
        return
    assert 0 <= q.limit <= len(q.token_ids) and all(0 <= t < 2**31 for t in q.token_ids)
    assert decode_request(encode_request(q.token_ids, q.salt, q.request_id, q.start, q.limit)[4:]) == q


@budget(ci=500)
def test_random_request_bodies(examples: int) -> None:
    explore(examples, check_decode, st.binary(max_size=200))


tokens = st.lists(st.integers(0, 2**31 - 1), max_size=40)
texts = st.text(max_size=20)


def check_round_trip(token_ids: list[int], salt: str, rid: str, start: int, limit: int | None) -> None:
    q = decode_request(encode_request(token_ids, salt, rid, start, limit)[4:])
    bound = len(token_ids) if limit is None else max(0, limit)
    assert q == Query(token_ids, salt or None, rid, max(0, start), min(bound, len(token_ids)))


@budget(ci=300)
def test_requests_round_trip(examples: int) -> None:
    explore(examples, check_round_trip, tokens, texts, texts, st.integers(0, 2**32 - 1),
            st.none() | st.integers(0, 2**32 - 1))


# --- the server side ----------------------------------------------------------------------
def frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


good_frames = st.builds(lambda t, s, r, a, b: encode_request(t, s, r, a, b), tokens, texts, texts,
                        st.integers(0, 50), st.none() | st.integers(0, 50))


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["good", "good", "body", "length", "huge", "raw"]))
    if kind == "good":
        return draw(good_frames)
    if kind == "body":  # a right length, a random body
        return frame(draw(st.binary(max_size=60)))
    if kind == "length":  # a good body under a wrong length
        body = draw(good_frames)[4:]
        return struct.pack("<I", max(0, len(body) + draw(st.integers(-8, 8)))) + body
    if kind == "huge":
        return struct.pack("<I", draw(st.sampled_from([MAX_REQUEST_BYTES + 1, 2**32 - 1]))) + b"\x00" * 8
    return draw(st.binary(max_size=40))


def expected_answers(data: bytes) -> bytes:
    """What the server sends back for ``data`` then EOF: the answers of the leading whole,
    well-formed requests (it hangs up at the first other one)."""
    out, at = b"", 0
    while len(data) - at >= 4:
        (size,) = struct.unpack_from("<I", data, at)
        if size > MAX_REQUEST_BYTES or len(data) - at - 4 < size:
            break
        try:
            q = decode_request(data[at + 4 : at + 4 + size])
        except ValueError:
            break
        out += answer_bytes(q)
        at += 4 + size
    return out


def exchange(path: str, data: bytes) -> bytes:
    """Send ``data``, half-close, and read everything until the server hangs up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may hang up first
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"the server hung on {data[:80]!r}") from None
        return got


def check_server(server: LookupServer, client: LookupClient, parts: list[bytes]) -> None:
    data = b"".join(parts)
    assert exchange(server.path, data) == expected_answers(data)
    q = Query([1, 2, 3, 4, 5], "t", "r-1", 2, 5)
    assert client.lookup(q.token_ids, q.salt, request_id=q.request_id, start=q.start, limit=q.limit) == answer(q), \
        "the server stopped answering good requests"


@budget(ci=500)
def test_random_frames_to_the_server(examples: int, server: LookupServer) -> None:
    client = LookupClient(server.path, timeout_s=TIMEOUT_S)
    try:
        explore(examples, check_server, st.lists(frames(), max_size=5), server=server, client=client)
    finally:
        client.close()


# --- the client side ----------------------------------------------------------------------
class GarblingServer:
    """Answers each request on ``path`` with ``reply`` (then hangs up, or with ``hold`` keeps
    the connection open, so the client must time out)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reply, self.hold = b"", False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._sock.accept()
                threading.Thread(target=self._serve, args=(conn, self.reply, self.hold), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket, reply: bytes, hold: bool) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(TIMEOUT_S)
            (size,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            conn.recv(size, socket.MSG_WAITALL)
            conn.sendall(reply)
            while hold and conn.recv(4096):
                pass

    def close(self) -> None:
        self._sock.close()


@pytest.fixture(scope="module")
def garbling(tmp_path_factory) -> Iterator[GarblingServer]:
    s = GarblingServer(str(tmp_path_factory.mktemp("garble") / "g.sock"))
    yield s
    s.close()


CLIENT_TIMEOUT_S = 0.05
replies = st.one_of(
    st.binary(max_size=30),
    st.builds(lambda f, n, rest: struct.pack("<II", f, n) + rest, st.integers(0, 2**32 - 1),
              st.integers(0, 2**32 - 1), st.binary(max_size=30)),
    st.builds(lambda f, src: struct.pack("<II", f, len(src)) + src, st.integers(0, 12), st.binary(max_size=12)),
)
salts = st.none() | st.sampled_from(["t", "\ud800", "é"]) | st.text(max_size=4)
lookup_tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=10) | st.sampled_from([[-1], [2**31]])


@example(reply=struct.pack("<II", 1, 2**32 - 1), hold=False, token_ids=[1], salt=None)  # 4 GiB of sources
@example(reply=struct.pack("<II", 9, 0), hold=False, token_ids=[1, 2], salt=None)  # more tokens than asked
@example(reply=b"", hold=False, token_ids=[1], salt="\ud800")  # a salt UTF-8 cannot carry
def check_client(garbling: GarblingServer, reply: bytes, hold: bool, token_ids: list[int],
                 salt: str | None) -> None:
    garbling.reply, garbling.hold = reply, hold
    client = LookupClient(garbling.path, timeout_s=CLIENT_TIMEOUT_S)
    began = time.monotonic()
    try:
        got = client.lookup(token_ids, salt)
    finally:
        client.close()
    assert time.monotonic() - began < CLIENT_TIMEOUT_S * 2 + 1.0, "the client waited past its timeout"
    if got != MISS:  # only an answer that fits the question, as sent
        found, sources = got
        assert found <= len(token_ids) and len(sources) <= len(token_ids) * MAX_GROUPS
        assert reply[: 8 + len(sources)] == struct.pack("<II", found, len(sources)) + bytes(sources)


@budget(ci=500)
def test_garbled_answers_to_the_client(examples: int, garbling: GarblingServer) -> None:
    explore(examples, check_client, replies, st.integers(0, 19).map(lambda i: i == 0), lookup_tokens, salts,
            garbling=garbling)
