"""Faults with real processes and SIGKILL (issue 27) that test_clients and test_server leave out.

- The server killed twice while two bundled-engine processes answer back-to-back requests: once
  a load holds a lease (it holds every prompt), once the first store has begun (it was just
  restarted, empty). Every request completes with the reference tokens; once the server is back, each
  client reconnects after its backoff and hits again.
- A ``KVCacheEngine`` process killed while it holds a reservation (a store of 8 MiB in flight)
  or only leases (a retrieve in flight): the server drops its claims, and once the chunks it
  committed are removed the server's accounting is what it was before the client came.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import xxhash

from kvlayer import KVCacheEngine, KVLayout
from kvlayer.cacheserver import protocol as wire
from kvlayer.cacheserver.protocol import Op
from kvlayer.engine import SamplingParams

from . import worker
from .conftest import ROOT, ServerProcess

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MIB = 2**20


def spawn(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    return subprocess.Popen([sys.executable, "-m", "tests.cacheserver.worker", *args], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


@pytest.fixture
def clients(server: ServerProcess, tiny_model_dir: str) -> Iterator[list[subprocess.Popen[str]]]:
    """Two bundled-engine processes, clients of ``server`` (conftest: 4 MiB), started once it listens."""
    procs = [spawn("serve", server.socket_path, tiny_model_dir) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait(10)


def ask(procs: list[subprocess.Popen[str]], n: int) -> None:
    for p in procs:
        p.stdin.write(f"{n}\n")
        p.stdin.flush()


def answers(p: subprocess.Popen[str], n: int) -> list[dict]:
    out = []
    for _ in range(n):
        line = p.stdout.readline()
        assert line, f"client {p.pid} exited with {p.wait(10)}"
        out.append(json.loads(line))
    return out


def test_a_server_killed_mid_load_and_mid_store_fails_no_request(server, clients, reference):
    want = [list(o.outputs[0].token_ids)
            for o in reference.generate([{"prompt_token_ids": p} for p in worker.SERVE_PROMPTS], GREEDY)]

    def served(n: int, kill_when=None) -> list[list[dict]]:
        """``n`` requests per client; the server killed as soon as its stats satisfy ``kill_when``."""
        ask(clients, n)
        if kill_when is not None:
            with server.client() as c:
                deadline = time.monotonic() + 60
                while not kill_when(seen := c.stats()):
                    assert time.monotonic() < deadline, seen
            server.kill()
        got = [answers(p, n) for p in clients]
        for mine in got:
            assert [a["tokens"] for a in mine] == [want[a["i"] % 3] for a in mine]
        return got

    first = served(6)  # each client stores its prompts or hits the other's
    assert all(sum(a["external"] > 0 for a in mine) >= 3 for mine in first)
    served(12, kill_when=lambda s: s.leases > 0)  # killed mid-load: every prompt is held, one is leased
    misses = served(3)
    assert [a["external"] for mine in misses for a in mine] == [0] * 6
    server.start()
    served(9, kill_when=lambda s: s.reserved + s.chunks > 0)  # mid-store, into the fresh, empty server
    server.start()
    for _ in range(40):  # back after the backoff (100-200 ms): stores, then hits again
        last = served(3)
        if all(any(a["external"] == 64 for a in mine) for mine in last):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"no hits after the restart: {last}")
    stats = server.wait_stats(lambda s: s.leases == 0 and s.reserved == 0)
    assert stats.chunks == 3 * 4 and stats.connections == 3  # both clients connected again


@pytest.mark.parametrize("claim", ["reservation", "leases only"])
def test_a_client_killed_mid_copy_leaks_no_lease_and_no_memory(sock_path, claim):
    server = ServerProcess(sock_path, "16MiB").start()
    try:
        with server.client() as c:
            c.reserve([(wire.Key(b"z" * 32, b"t" * 16), 4096)])  # a chunk of ours, there all along
            c.commit([(b"z" * 32, xxhash.xxh3_64_intdigest(bytes(4096)))])  # unwritten: zeros, sealed
            c.release([b"z" * 32])
            before = server.wait_stats(lambda s: s.sealed == 1)
            child = spawn("churn", sock_path)
            try:
                for _ in range(2):
                    assert child.stdout.readline().strip() == "looped"
                holding = (lambda s: s.reserved > 0) if claim == "reservation" else \
                    (lambda s: s.leases > 0 and s.reserved == 0)
                deadline = time.monotonic() + 30
                while not holding(seen := c.stats()):
                    assert time.monotonic() < deadline, seen
                child.send_signal(signal.SIGKILL)  # at once: the claim seen is still held, a copy under it
            finally:
                child.kill()
                child.wait(10)
            assert seen.connections == 2
        after = server.wait_stats(lambda s: s.connections == 1 and s.leases == 0)
        assert after.reserved == 0 and after.used_bytes == 4096 + (after.chunks - 1) * MIB
        layout = KVLayout(dtype=worker.layout().dtype, **worker.BIG)
        config = {**worker.kv_config(sock_path), "chunk_size": 64}
        with KVCacheEngine(config, layout, model_name="big", model_fingerprint="f") as kv:
            digests = [k.digest for k in kv.keys(worker.BIG_TOKENS)]
        with server.client() as c:
            assert wire.parse_count(c.call(Op.REMOVE, wire.digests(digests))) == after.chunks - 1
            assert c.stats()._replace(connections=0) == before._replace(connections=0)
    finally:
        server.stop()


def test_a_chunk_is_hashed_once_per_commit_and_a_restored_one_again(unscrubbed):
    """``cache_server_verify: first`` (the server's seals not trusted): a warm chunk is not hashed
    again; one stored anew at the same offset with the same bytes (so the same checksum) and then
    damaged is still a counted miss: this process's own reservation there dropped the record of
    the first commit."""
    server = unscrubbed
    config = {**worker.kv_config(server.socket_path), "cache_server_verify": "first"}
    with KVCacheEngine(config, worker.layout(), model_name="m", model_fingerprint="f") as kv:
        src, at, dst = worker.kv_caches(3), worker.slots(40, 0), worker.kv_caches(None)
        assert kv.store(worker.TOKENS, src, at) == 5
        for _ in range(3):
            assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 40
        backend = kv.stats()["tiers"]["cache"]["backend"]
        assert (backend["verified"], backend["checksum_errors"]) == (5, 0)
        keys = [wire.Key(k.digest, k.tokens_digest) for k in kv.keys(worker.TOKENS)]
        with server.client() as c:
            offsets = [lease.offset for lease in c.lease(keys)]
        assert kv.remove(kv.keys(worker.TOKENS)) >= 5
        assert kv.store(worker.TOKENS, src, at) == 5
        with server.client() as c:
            assert [lease.offset for lease in c.lease(keys)] == offsets  # first fit: the same ranges
            path = c.welcome.path
        server.wait_stats(lambda s: s.sealed == 5)  # sealed before the damage: only the client can find it
        with open(path, "r+b") as f:  # a stray write into the third chunk, before this process reads it
            f.seek(offsets[2] + 64)
            f.write(b"\x00\x01\x02")
        assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 16
        backend = kv.stats()["tiers"]["cache"]["backend"]
        # all five leased in one batch and hashed again: four pass, the damaged one fails
        assert (backend["verified"], backend["checksum_errors"]) == (9, 1) and backend["held"] == 0
        assert worker.rows(dst, worker.slots(16, 20)) == worker.rows(src, worker.slots(16, 0))
