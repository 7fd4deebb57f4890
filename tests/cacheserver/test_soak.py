"""The soak (issue 27): 3 client processes, 1,020 requests, a server far smaller than their working set.

Each request retrieves one of ``worker.SOAK_SEQS`` sequences (5 chunks of 3 KiB each, 900 KiB in
all) and stores it again, so the 256 KiB server evicts all the time. Sampled meanwhile, the
server's used bytes never pass its capacity; every hit is the stored KV byte for byte; at the
end no lease or reservation is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from .conftest import ROOT, ServerProcess

pytestmark = pytest.mark.timeout(120)
CLIENTS = 3
REQUESTS = 340  # per client


def test_three_clients_under_constant_eviction(sock_path):
    server = ServerProcess(sock_path, "256KiB").start()
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        with server.client() as c:
            while not stop.is_set():
                s = c.stats()
                samples.append((s.used_bytes, s.capacity_bytes))
                stop.wait(0.01)

    sampler = threading.Thread(target=sample)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    try:
        sampler.start()
        procs = [subprocess.Popen([sys.executable, "-m", "tests.cacheserver.worker", "soak", sock_path, str(seed),
                                   str(REQUESTS)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for seed in range(CLIENTS)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=100)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        stop.set()
        sampler.join(10)
        end = server.wait_stats(lambda s: s.connections == 1 and s.leases == 0)
    finally:
        stop.set()
        server.stop()
    assert sum(r["requests"] for r in results) == CLIENTS * REQUESTS >= 1000
    assert [r["bad_hits"] for r in results] == [0] * CLIENTS
    assert all(r["hit_tokens"] > 0 for r in results)  # hits while evicting: the soak checked bytes
    assert len(samples) > 50 and all(used <= cap for used, cap in samples), max(samples)
    assert end.capacity_bytes == 256 * 1024 and end.reserved == 0 and end.evictions > 200
    assert end.used_bytes == end.chunks * 3 * 1024  # only committed chunks hold memory
