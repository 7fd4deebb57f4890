"""The server process over its socket: malformed frames, tokens, dead clients and capacity."""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import subprocess
import sys

import pytest
import xxhash

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.protocol import ErrorCode, Key, Op, Status
from kvlayer.cacheserver.sync_client import ServerError, SyncClient

from .conftest import ROOT, ServerProcess


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def closed_after_error(s: socket.socket) -> int:
    """Read to the end: the ERROR frame's code, then EOF (the server closed this connection)."""
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    op, _, _, length = wire.FRAME.unpack_from(data)
    assert op == Op.ERROR and len(data) == wire.FRAME.size + length
    return wire.parse_error(data[wire.FRAME.size:])[0]


def greeted(path: str) -> socket.socket:
    s = raw(path)
    s.sendall(wire.frame(Op.HELLO, wire.hello(None)))
    header = s.recv(wire.FRAME.size, socket.MSG_WAITALL)
    s.recv(wire.FRAME.unpack(header)[3], socket.MSG_WAITALL)
    return s


def test_socket_and_arena_are_private(server):
    assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o600
    with server.client() as c:
        assert stat.S_IMODE(os.stat(c.welcome.path).st_mode) == 0o600
        assert c.welcome.data_offset == 4096 and c.welcome.arena_bytes == 4096 + 4 * 1024**2


BAD_FRAMES = {
    "padding": wire.FRAME.pack(Op.STATS, 1, 0, 0),
    "too long": wire.FRAME.pack(Op.LOOKUP, 0, 0, wire.MAX_BODY + 1),
    "unknown op": wire.frame(77),  # type: ignore[arg-type]
    "hello twice": wire.frame(Op.HELLO, wire.hello(None)),
    "count mismatch": wire.frame(Op.LOOKUP, struct.pack("<I", 3) + b"k" * wire.KEY_BYTES),
    "too many items": wire.frame(Op.RELEASE, struct.pack("<I", wire.MAX_ITEMS + 1)),
    "size zero": wire.frame(Op.RESERVE, wire.reserve([(Key(b"a" * 32, b"b" * 16), 0)])),
    "size past the arena": wire.frame(Op.RESERVE, wire.reserve([(Key(b"a" * 32, b"b" * 16), 2**40)])),
    "stats with a body": wire.frame(Op.STATS, b"x"),
}


@pytest.mark.parametrize("name", BAD_FRAMES)
def test_a_malformed_frame_closes_that_connection_only(server, name):
    with server.client() as other:
        other.reserve([(Key(b"c" * 32, b"d" * 16), 512)])  # another client's reservation, held meanwhile
        bad = greeted(server.socket_path)
        bad.sendall(BAD_FRAMES[name])
        assert closed_after_error(bad) == ErrorCode.MALFORMED
        stats = other.stats()  # the other connection goes on, its claims intact
        assert stats.reserved == 1 and stats.connections == 1 and stats.used_bytes == 512


def test_the_first_frame_must_be_hello(server):
    s = raw(server.socket_path)
    s.sendall(wire.frame(Op.STATS))
    assert closed_after_error(s) == ErrorCode.NOT_HELLO
    s = raw(server.socket_path)
    s.sendall(wire.frame(Op.HELLO, b"KVCS\x09\x00\x00\x00"))
    assert closed_after_error(s) == ErrorCode.BAD_VERSION


def test_a_token_is_required_when_configured(sock_path):
    proc = ServerProcess(sock_path, "1MiB", token="s3cret").start()
    try:
        for wrong in (None, "s3cret!"):
            with pytest.raises(ServerError) as e:
                SyncClient(sock_path, wrong)
            assert e.value.code == ErrorCode.BAD_TOKEN
        with SyncClient(sock_path, "s3cret") as c:
            assert c.stats().connections == 1
    finally:
        assert proc.stop() == 0
    assert not os.path.exists(sock_path)  # a clean stop removes the socket


def test_a_second_server_on_a_live_socket_is_refused(server):
    out = subprocess.run([sys.executable, "-m", "kvlayer.cli", "cache-server", "--socket", server.socket_path,
                          "--cpu-capacity", "1MiB"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "another cache server is listening" in out.stderr
    with server.client() as c:  # the live server keeps its socket and its arena file
        assert c.stats().capacity_bytes == 4 * 1024**2 and os.path.exists(c.welcome.path)


def test_a_killed_client_leaks_no_lease_and_no_memory(server):
    with server.client() as c:
        c.reserve([(Key(b"z" * 32, b"t" * 16), 2048)])
        c.commit([(b"z" * 32, xxhash.xxh3_64_intdigest(bytes(2048)))])  # the arena's zeros: the server seals it
        before = c.stats()
        child = subprocess.Popen([sys.executable, "-m", "tests.cacheserver.worker", "hold", server.socket_path, "6"],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "holding"
            held = c.stats()
            # 6 committed (each the writer's lease) and leased again, 6 reserved
            assert (held.leases, held.reserved, held.chunks) == (before.leases + 12, 6, before.chunks + 6)
            assert held.used_bytes == before.used_bytes + 12 * 4096
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
    after = server.wait_stats(lambda s: s.connections == 1 and s.leases == 0)  # ours went with our connection
    assert (after.reserved, after.chunks) == (0, before.chunks + 6)  # committed chunks stay, unleased
    with server.client() as c:
        assert c.call(Op.REMOVE, wire.digests([bytes([i]) * 32 for i in range(6)])) == wire.count(6)
        assert c.stats().used_bytes == before.used_bytes


def test_capacity_holds_under_constant_eviction(server):
    chunk = 64 * 1024
    capacity = 4 * 1024**2
    with server.client() as c:
        pinned = Key(b"p" * 32, b"t" * 16)
        c.reserve([(pinned, chunk)])
        zeros = xxhash.xxh3_64_intdigest(bytes(chunk))  # no chunk is written: the right checksum is of zeros
        c.commit([(pinned.digest, zeros)])
        assert c.lease([pinned])[0].status is Status.OK  # leased: must survive every eviction
        for i in range(300):  # 300 x 64 KiB = 4.7x the capacity, in batches of 3
            keys = [Key((3 * i + j).to_bytes(32, "little"), b"t" * 16) for j in range(3)]
            slots = c.reserve([(k, chunk) for k in keys])
            assert [s.status for s in slots] == [Status.OK] * 3
            assert all(4096 <= s.offset <= 4096 + capacity - chunk for s in slots)
            c.commit([(k.digest, zeros) for k in keys])
            c.release([k.digest for k in keys])  # written: the commit's lease goes back
            stats = c.stats()
            assert stats.used_bytes <= stats.capacity_bytes == capacity
        stats = c.stats()
        assert stats.evictions == 300 * 3 + 1 - capacity // chunk and stats.chunks == capacity // chunk
        assert c.lookup([pinned]) == 1 and c.lease([pinned])[0].checksum == zeros
        newest = [Key((3 * 299 + j).to_bytes(32, "little"), b"t" * 16) for j in range(3)]
        assert c.lookup(newest) == 3


@pytest.mark.parametrize(("extra", "arena"), [("", "4.0GiB"), ("cpu_capacity: 8MiB\n", "8.0MiB")])
def test_a_config_that_names_the_socket_sizes_the_arena(tmp_path, sock_path, extra, arena):
    """``cache_server`` in the server's own config turns a client's CPU tier off
    (``TierSettings.replaces``); the server still takes the CPU tier's size: the config's, or its default."""
    config = tmp_path / "server.yaml"
    config.write_text(f"cache_server: {sock_path}\n{extra}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvlayer.cli", "cache-server", "--config", str(config)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"listening on {sock_path} ({arena} arena" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
