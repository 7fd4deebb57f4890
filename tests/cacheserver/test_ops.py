"""Running the cache server as a service: the socket's group, the token, the Prometheus endpoint."""

from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.protocol import ErrorCode, Key, Op, Status
from kvlayer.cacheserver.sync_client import ServerError, SyncClient

from .conftest import ROOT, ServerProcess


class FlaggedServer(ServerProcess):
    """A ``ServerProcess`` started with more flags (``--salt-quota``, ``--metrics-port``, ...)."""

    def __init__(self, socket_path: str, capacity: str, *flags: str, token: str | None = None) -> None:
        super().__init__(socket_path, capacity, token)
        self.flags = list(flags)

    def start(self) -> FlaggedServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
        if self.token:
            env["KVLAYER_CACHE_SERVER_TOKEN"] = self.token
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlayer.cli", "cache-server", "--socket",
                                      self.socket_path, "--cpu-capacity", self.capacity, *self.flags],
                                     env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.proc.stdout.read()
        return self


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = env or {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    return subprocess.run([sys.executable, "-m", "kvlayer.cli", "cache-server", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_socket_group_makes_socket_and_arena_0660_of_that_group(sock_path):
    group = grp.getgrgid(os.getgid())  # our own group: a user may give a file to a group it is in
    proc = FlaggedServer(sock_path, "1MiB", "--socket-group", group.gr_name).start()
    try:
        with proc.client() as c:
            for path in (sock_path, c.welcome.path):
                st = os.stat(path)
                assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, group.gr_gid), path
    finally:
        assert proc.stop() == 0


def test_a_group_that_does_not_exist_is_one_line_at_start(sock_path):
    out = run_cli("--socket", sock_path, "--cpu-capacity", "1MiB", "--socket-group", "no-such-group-kvlayer")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["kvlayer: error: --socket-group no-such-group-kvlayer: no such group"]
    assert not os.path.exists(sock_path)


def test_a_wrong_token_is_refused_clearly_and_counted(sock_path, tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    proc = FlaggedServer(sock_path, "1MiB", "--token-file", str(token), "--metrics-port", str(port)).start()
    try:
        with pytest.raises(ServerError, match="wrong cache_server_token") as e:
            SyncClient(sock_path, "guess")
        assert e.value.code == ErrorCode.BAD_TOKEN
        wrong = tmp_path / "wrong"
        wrong.write_text("guess\n")
        out = run_cli("--socket", sock_path, "--stats", "--token-file", str(wrong))
        assert out.returncode == 2
        assert out.stderr.strip() == (f"kvlayer: error: cache server at {sock_path}: cache server error "
                                      f"{int(ErrorCode.BAD_TOKEN)}: wrong cache_server_token")
        out = run_cli("--socket", sock_path, "--stats", "--token-file", str(token))
        assert out.returncode == 0 and "connections: 1" in out.stdout, out.stderr
        metrics = scrape(port)
        assert metrics[("kvlayer_cache_server_refused_connections_total", (("reason", "bad_token"),))] == 2
        assert metrics[("kvlayer_cache_server_accepted_connections_total", ())] == 3
    finally:
        assert proc.stop() == 0


def test_the_metrics_follow_a_store_and_a_lease(sock_path):
    port = free_port()
    proc = FlaggedServer(sock_path, "4MiB", "--metrics-port", str(port), "--salt-quota", "0.5").start()
    try:
        before = scrape(port)
        assert before[("kvlayer_cache_server_capacity_bytes", ())] == 4 * 1024**2
        assert before[("kvlayer_cache_server_salt_quota_bytes", ())] == 2 * 1024**2
        assert before[("kvlayer_cache_server_used_bytes", ())] == 0
        assert before[("kvlayer_cache_server_chunks", ())] == 0
        tenant = b"T" * wire.TENANT_BYTES
        keys = [Key(bytes([i]) * 32, b"t" * 16) for i in range(3)]
        with proc.client() as c:
            assert [s.status for s in c.reserve([wire.Reserve(k, 5000, tenant) for k in keys])] == [Status.OK] * 3
            assert c.commit([(k.digest, xxhash.xxh3_64_intdigest(bytes(5000))) for k in keys]) == 3
            assert c.release([k.digest for k in keys]) == 3
            assert c.lookup(keys + [Key(b"x" * 32, b"t" * 16)]) == 3
            assert [x.status for x in c.lease([keys[0], Key(b"y" * 32, b"t" * 16)])] == [Status.OK, Status.MISSING]
            during = scrape(port)
        after = scrape(port)
    finally:
        assert proc.stop() == 0
    size = 3 * 5120  # 5000 bytes round up to 20 ranges of 256
    assert during[("kvlayer_cache_server_used_bytes", ())] == size
    assert during[("kvlayer_cache_server_chunks", ())] == 3
    assert during[("kvlayer_cache_server_leases", ())] == 1
    assert during[("kvlayer_cache_server_connections", ())] == 1
    assert during[("kvlayer_cache_server_tenant_used_bytes", (("tenant", tenant.hex()),))] == size
    assert during[("kvlayer_cache_server_tenant_chunks", (("tenant", tenant.hex()),))] == 3
    assert during[("kvlayer_cache_server_lookup_chunks_total", (("result", "hit"),))] == 3
    assert during[("kvlayer_cache_server_lookup_chunks_total", (("result", "miss"),))] == 1
    assert during[("kvlayer_cache_server_lease_chunks_total", (("result", "hit"),))] == 1
    assert during[("kvlayer_cache_server_lease_chunks_total", (("result", "miss"),))] == 1
    assert (after[("kvlayer_cache_server_leases", ())], after[("kvlayer_cache_server_connections", ())]) == (0, 0)
    assert after[("kvlayer_cache_server_used_bytes", ())] == size  # the chunks stay; the lease went with its client


def test_the_endpoint_answers_metrics_only(sock_path):
    port = free_port()
    proc = FlaggedServer(sock_path, "1MiB", "--metrics-port", str(port)).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
        assert e.value.code == 404
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # junk, then the server goes on
            s.sendall(b"\x00\xff junk\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 405")
        assert scrape(port)[("kvlayer_cache_server_connections", ())] == 0
        with proc.client() as c:
            assert c.call(Op.STATS) and c.stats().capacity_bytes == 1024**2
    finally:
        assert proc.stop() == 0


def test_a_taken_metrics_port_is_one_line_at_start(sock_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("--socket", sock_path, "--cpu-capacity", "1MiB", "--metrics-port", str(port))
    assert out.returncode == 2 and not os.path.exists(sock_path)
    assert out.stderr.strip().splitlines() == [f"kvlayer: error: --metrics-port {port}: cannot listen on "
                                               "127.0.0.1: Address already in use"]
