"""kvlayer in vLLM with tensor parallelism (vLLM's CPU build, ``tensor_parallel_size`` 2, one
core per rank): each rank stores and loads its own shard of the KV heads under keys of its own,
a chunk counts as held only when every rank holds its shard, and a rank's failed load is
recomputed by vLLM. Greedy tokens must equal vLLM's own at TP=2 without kvlayer.

Engines: vLLM alone (the reference), a first kvlayer engine that stores into CPU, NVMe and
Redis (and hits the CPU tier), a restarted one that reads the NVMe files and Redis after the
test has removed and damaged some ranks' shards, and a TP=1 engine on the same files.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import redis

from kvlayer.backends.nvme_files import chunk_path
from kvlayer.engine.presets import init_model
from tests.connectors.vllm_drive import drive
from tests.redis_server import RedisServer, require_binary

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM's CPU build is installed by scripts/setup.sh test", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)
CHUNK = 64  # 2 vLLM blocks of 32
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (150, 200, 300, 170)]
NVME_HIT, REDIS_HIT, CORRUPT, EVICTED = range(4)
"""What the restarted engine finds of each prompt: every shard in NVMe; in Redis only; rank
1's shard corrupted on disk (its only copy); rank 1's shard gone."""


def hits(prompt: list[int]) -> int:
    usable = len(prompt) - 1
    return usable - usable % CHUNK


def tier_of(report: dict[str, Any], name: str) -> dict[str, Any]:
    return report["stats"]["tiers"][name]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-tp")


@pytest.fixture(scope="module")
def llama(work) -> str:
    return str(init_model("small", work / "llama", architecture="llama"))  # 4 KV heads: 2 per rank


@pytest.fixture(scope="module")
def server():
    require_binary("redis-server")
    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module")
def baseline(llama, work) -> list[list[int]]:
    run = drive({"model": llama, "kvlayer": None, "tensor_parallel_size": 2, "rounds": [{"prompts": PROMPTS}]},
                work, env=TP2)
    return run["rounds"][0]["tokens"]


@pytest.fixture(scope="module")
def first(llama, work, server) -> dict[str, Any]:
    cfg = {"cpu_capacity": "256MiB", "nvme_path": str(work / "nvme"), "nvme_capacity": "256MiB",
           "redis_url": server.url, "chunk_size": CHUNK}
    return drive({"model": llama, "kvlayer": cfg, "tensor_parallel_size": 2,
                  "rounds": [{"prompts": PROMPTS}, {"prompts": PROMPTS}]}, work, env=TP2)


def test_each_rank_stores_its_shard_and_cpu_hits_give_vllms_tokens(baseline, first) -> None:
    stored, again = first["rounds"]
    assert stored["tokens"] == again["tokens"] == baseline
    assert stored["cached"] == [0] * len(PROMPTS)
    assert again["cached"] == [hits(p) for p in PROMPTS], "every rank holds every shard: whole hits"
    ranks = again["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert tier_of(r, "cpu")["hit_tokens"] == sum(map(hits, PROMPTS)), f"rank {r['rank']} loaded its shard"
        for tier in ("cpu", "nvme", "redis"):
            assert {k for keys in r["keys"] for k in keys} <= set(r["held"][tier]), (r["rank"], tier)
    for k0, k1 in zip(ranks[0]["keys"], ranks[1]["keys"]):
        assert len(k0) == len(k1) == len(set(k0) | set(k1)) // 2, "the rank is in the namespace: keys of its own"


@pytest.fixture(scope="module")
def restarted(llama, work, server, first) -> dict[str, Any]:
    """The files and Redis keys of ``first``, changed as ``NVME_HIT``, ``REDIS_HIT``, ``CORRUPT``
    and ``EVICTED`` say, then read by a new TP=2 engine (no CPU tier), one prompt per round."""
    keys = [r["keys"] for r in first["rounds"][0]["ranks"]]  # keys[rank][prompt]
    root, db = str(work / "nvme"), redis.Redis.from_url(server.url)

    def files(rank: int, prompt: int) -> list[Path]:
        return [Path(chunk_path(root, bytes.fromhex(d), i * CHUNK)) for i, d in enumerate(keys[rank][prompt])]

    def drop_redis(rank: int, prompt: int) -> None:
        assert db.delete(*(n for d in keys[rank][prompt] for n in (f"kvlayer:{{{d}}}", f"kvlayer:{{{d}}}:b")))

    for rank in (0, 1):
        for f in files(rank, REDIS_HIT):
            f.unlink()
    damaged = files(1, CORRUPT)[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in the KV, past the header: found at start-up, refused when read
    damaged.write_bytes(bytes(data))
    drop_redis(1, CORRUPT)
    for f in files(1, EVICTED):
        f.unlink()
    drop_redis(1, EVICTED)
    cfg = {"cpu_capacity": 0, "nvme_path": root, "nvme_capacity": "256MiB", "redis_url": server.url,
           "chunk_size": CHUNK}
    return drive({"model": llama, "kvlayer": cfg, "tensor_parallel_size": 2,
                  "rounds": [{"prompts": [p]} for p in PROMPTS]}, work, env=TP2)


def _delta(run: dict[str, Any], rnd: int, rank: int, tier: str, counter: str) -> int:
    now = tier_of(run["rounds"][rnd]["ranks"][rank], tier)[counter]
    return now - (tier_of(run["rounds"][rnd - 1]["ranks"][rank], tier)[counter] if rnd else 0)


def test_a_restarted_engine_hits_nvme_then_redis_with_exact_tokens(baseline, restarted) -> None:
    rounds = restarted["rounds"]
    assert [r["tokens"][0] for r in rounds] == baseline
    for rnd, tier in ((NVME_HIT, "nvme"), (REDIS_HIT, "redis")):
        assert rounds[rnd]["cached"] == [hits(PROMPTS[rnd])], f"round {rnd} hits {tier}"
        for rank in (0, 1):
            assert _delta(restarted, rnd, rank, tier, "hit_tokens") == hits(PROMPTS[rnd]), (rnd, rank, tier)


def test_one_ranks_corrupted_shard_is_recomputed(baseline, restarted) -> None:
    rnd = CORRUPT
    assert restarted["rounds"][rnd]["tokens"][0] == baseline[rnd], "never wrong KV"
    assert _delta(restarted, rnd, 1, "nvme", "checksum_errors") >= 1
    assert restarted["rounds"][rnd]["ranks"][1]["stats"]["connector"]["failed_load_tokens"] > 0, \
        "rank 1 reported its failed load, and vLLM recomputed on every rank"
    assert _delta(restarted, rnd, 1, "nvme", "hit_tokens") < hits(PROMPTS[rnd])


def test_a_shard_one_rank_lost_is_a_miss_on_every_rank(baseline, restarted) -> None:
    rnd = EVICTED
    assert restarted["rounds"][rnd]["tokens"][0] == baseline[rnd]
    assert restarted["rounds"][rnd]["cached"] == [0], "rank 0 holds its shard, rank 1 not: nothing is held"
    for rank in (0, 1):
        assert _delta(restarted, rnd, rank, "nvme", "hit_tokens") == 0
        assert _delta(restarted, rnd, rank, "redis", "hit_tokens") == 0


def test_tp1_never_reads_tp2_chunks(llama, work, restarted) -> None:
    cfg = {"cpu_capacity": 0, "nvme_path": str(work / "nvme"), "nvme_capacity": "256MiB", "chunk_size": CHUNK}
    run = drive({"model": llama, "kvlayer": cfg, "rounds": [{"prompts": PROMPTS[:1]}]}, work)
    assert run["rounds"][0]["cached"] == [0], "TP=1 keys are not TP=2's"
    assert tier_of(run["rounds"][0], "nvme")["hit_tokens"] == 0
    assert list((work / "nvme").rglob("*.kvc")), "the TP=2 files are there to be (not) read"
