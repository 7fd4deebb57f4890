"""vLLM as a client of ``kvlayer cache-server`` (issue 27): the worker's kvlayer uses the node
server's shared CPU tier (the ``cache`` tier) instead of a CPU tier of its own, so a vLLM engine
started after another one exited hits, on its very first requests, the chunks the first stored
in CPU memory, with vLLM's own greedy tokens. One server process, three vLLM engines (the
reference without kvlayer, the one that stores, the one that hits).

Then the same at ``tensor_parallel_size`` 2 (vLLM's "mp" executor, one core per rank): both
ranks of a pair of engines are clients of the same server. The first engine computes every
token itself (nothing to load: its keys carry TP size 2), so its tokens are vLLM's own at TP=2;
the restarted one hits the server's CPU tier on its first requests on both ranks.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlayer.engine.presets import init_model
from tests.cacheserver.conftest import ServerProcess
from tests.connectors.vllm_drive import drive

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM's CPU build is installed by scripts/setup.sh test", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)
CHUNK = 64
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(11)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (150, 260, 200)]


PROMPTS = prompts()


def hits(prompt: list[int]) -> int:
    usable = len(prompt) - 1
    return usable - usable % CHUNK


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-cs")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory(prefix="kvcs-") as folder:  # AF_UNIX paths are short
        proc = ServerProcess(os.path.join(folder, "cache.sock"), "64MiB").start()
        yield proc
        proc.stop()


@pytest.fixture(scope="module")
def llama(work) -> str:
    return str(init_model("small", work / "llama", architecture="llama"))  # 4 KV heads: 2 per rank at TP=2


@pytest.fixture(scope="module")
def runs(work, server, llama) -> dict[str, Any]:
    cfg = {"cpu_capacity": 0, "cache_server": server.socket_path, "chunk_size": CHUNK}
    baseline = drive({"model": llama, "kvlayer": None, "rounds": [{"prompts": PROMPTS}]}, work)
    first = drive({"model": llama, "kvlayer": cfg, "rounds": [{"prompts": PROMPTS}]}, work)
    with server.client() as c:
        held = c.stats()
    second = drive({"model": llama, "kvlayer": cfg, "rounds": [{"prompts": PROMPTS}]}, work)
    return {"baseline": baseline, "first": first, "second": second, "held": held}


def test_a_second_vllm_hits_the_servers_cpu_tier_on_its_first_requests(runs) -> None:
    ref = runs["baseline"]["rounds"][0]["tokens"]
    first, second = runs["first"]["rounds"][0], runs["second"]["rounds"][0]
    assert first["tokens"] == second["tokens"] == ref, "vLLM's own greedy tokens, stored and hit"
    assert first["cached"] == [0] * len(PROMPTS)
    assert second["cached"] == [hits(p) for p in PROMPTS], "the first requests of a new engine hit"
    tiers = second["stats"]["tiers"]
    assert "cpu" not in tiers and tiers["cache"]["hit_tokens"] == sum(map(hits, PROMPTS))


def test_the_chunks_live_in_the_server_not_the_engine(runs) -> None:
    held = runs["held"]  # after the first engine exited
    assert held.chunks == sum(hits(p) // CHUNK for p in PROMPTS) and held.leases == 0 and held.reserved == 0, held
    assert held.used_bytes > 0 and held.connections == 1, "only the stats call itself: the engine's is gone"


@pytest.fixture(scope="module")
def tp2(work, server, llama) -> dict[str, Any]:
    cfg = {"cpu_capacity": 0, "cache_server": server.socket_path, "chunk_size": CHUNK}
    spec = {"model": llama, "kvlayer": cfg, "tensor_parallel_size": 2, "rounds": [{"prompts": PROMPTS}]}
    first = drive(spec, work, env=TP2)
    second = drive(spec, work, env=TP2)
    with server.client() as c:
        held = c.stats()
    return {"first": first["rounds"][0], "second": second["rounds"][0], "held": held}


def test_both_tp_ranks_of_a_restarted_vllm_hit_the_server(tp2) -> None:
    first, second = tp2["first"], tp2["second"]
    assert first["cached"] == [0] * len(PROMPTS), "TP=2 keys of their own: the first engine computed all"
    assert second["tokens"] == first["tokens"], "vLLM's own TP=2 greedy tokens, from the server's chunks"
    assert second["cached"] == [hits(p) for p in PROMPTS]
    assert [r["rank"] for r in second["ranks"]] == [0, 1]
    for r in second["ranks"]:
        tiers = r["stats"]["tiers"]
        assert "cpu" not in tiers and tiers["cache"]["hit_tokens"] == sum(map(hits, PROMPTS)), r["rank"]
        assert tiers["cache"]["backend"]["held"] == 0, f"rank {r['rank']} holds no view after its requests"
    held = tp2["held"]  # after both engines exited
    assert held.leases == 0 and held.reserved == 0 and held.connections == 1, held
