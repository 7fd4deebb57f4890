"""Asynchronous loads in kvlayer's vLLM connector (``async_loads``, docs/vllm.md).

Bookkeeping on hand-made scheduler outputs (no vLLM): which hits go the async way, the step
that carries them, the request's second allocation, an abort (the worker's loads themselves:
tests/kvlayer/test_async_loads.py).
Then one vLLM engine (CPU build, ``tests/connectors/vllm_driver.py``) with the NVMe and Redis
tiers and no CPU tier, shared by the module: its first round computes (every token vLLM's own),
the next hit NVMe asynchronously, corrupted NVMe files are failed loads that vLLM then finds
in Redis (asynchronously too), and those loads bring the chunks back to NVMe. Greedy tokens must
stay those of the first round.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvlayer.config import KVLayerConfig
from kvlayer.connectors.vllm_scheduler import SchedulerSide
from tests.connectors.test_vllm_scheduler import BS, CHUNK, output, request
from tests.redis_server import RedisServer, require_binary


class TieredLookups:
    """Finds ``found`` tokens, every chunk in tier ``tier``."""

    def __init__(self, found: int, tier: int) -> None:
        self.found, self.tier = found, tier

    def lookup(self, token_ids, salt, *, request_id="", start=0, limit=None):
        found = min(self.found, len(token_ids) if limit is None else limit)
        return found, (self.tier,) * (found // CHUNK)


def side(tier: int, **config: Any) -> SchedulerSide:
    cfg = KVLayerConfig(chunk_size=CHUNK, cpu_capacity="1MiB", nvme_path="/tmp/unused-nvme", **config)
    return SchedulerSide(cfg, TieredLookups(16, tier), BS)


def test_an_nvme_hit_loads_async_in_the_step_after_its_allocation() -> None:
    s = side(tier=1)  # tiers: cpu 0, nvme 1
    r = request("a", 17)
    assert s.matched(r, 0) == 16 and s.loads_async("a")
    s.allocated(r, [10, 11, 12, 13, 14], 16)
    spec = s.build(output())  # vLLM keeps the request waiting: not scheduled
    assert spec.loads == () and [ld.request_id for ld in spec.async_loads] == ["a"]
    ld = spec.async_loads[0]
    assert (ld.start, ld.end, ld.block_ids, ld.sources) == (0, 16, (10, 11, 12, 13), (1, 1))
    assert s.async_loads == 1
    assert s.build(output()).async_loads == (), "handed over once"
    s.allocated(r, [10, 11, 12, 13, 14, 15], 0)  # loaded: vLLM allocates again, nothing to load
    spec = s.build(output(new=[("a", [10, 11, 12, 13, 14, 15], 16)], scheduled={"a": 1}))
    assert spec.loads == () and spec.async_loads == ()
    assert [(sv.first, sv.block_ids) for sv in spec.saves] == [(0, (10, 11, 12, 13))], "its chunks saved"


def test_a_cpu_hit_and_async_loads_off_stay_in_the_step() -> None:
    for s in (side(tier=0), side(tier=1, async_loads=False)):
        r = request("a", 17)
        assert s.matched(r, 0) == 16 and not s.loads_async("a")
        s.allocated(r, [10, 11, 12, 13, 14], 16)
        spec = s.build(output(new=[("a", [10, 11, 12, 13, 14], 0)], scheduled={"a": 1}))
        assert [ld.request_id for ld in spec.loads] == ["a"] and spec.async_loads == ()


def test_a_request_aborted_before_its_step_loads_nothing() -> None:
    s = side(tier=1)
    r = request("a", 17)
    s.matched(r, 0)
    s.allocated(r, [10, 11, 12, 13, 14], 16)
    s.finished("a")
    assert s.build(output(finished=["a"])).async_loads == ()


# --- in vLLM -----------------------------------------------------------------------------------
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM's CPU build is installed by scripts/setup.sh test", allow_module_level=True)

from kvlayer.engine.presets import init_model  # noqa: E402
from tests.connectors.test_vllm_v1 import CHUNK as VLLM_CHUNK  # noqa: E402
from tests.connectors.test_vllm_v1 import PROMPTS, hits, tier  # noqa: E402
from tests.connectors.vllm_drive import at_gate, drive, result  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the module's engine: four rounds, a minute on 2 cores


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    """Rounds: 0 computes, 1 hits NVMe, then every NVMe file is corrupted, 2 fails to read them
    and hits Redis, 3 hits NVMe again. ``files``: how many NVMe files were corrupted."""
    require_binary("redis-server")
    work = tmp_path_factory.mktemp("vllm-async")
    model = str(init_model("small", work / "llama", architecture="llama"))
    nvme = work / "nvme"
    with RedisServer() as server:
        cfg = {"cpu_capacity": 0, "nvme_path": str(nvme), "nvme_capacity": "256MiB", "redis_url": server.url,
               "chunk_size": VLLM_CHUNK}
        gate = work / "corrupted"
        proc = drive({"model": model, "kvlayer": cfg, "rounds": [
            {"prompts": PROMPTS}, {"prompts": PROMPTS}, {"prompts": PROMPTS, "wait_for": str(gate)},
            {"prompts": PROMPTS}]}, work, background=True)
        at_gate(proc, gate)
        files = sorted(nvme.rglob("*.kvc"))
        for f in files:  # one byte flipped in the middle of every chunk's KV
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        gate.touch()
        out = result(proc)
    out["files"] = len(files)
    return out


def counts(run: dict[str, Any], rnd: int) -> dict[str, int]:
    return run["rounds"][rnd]["stats"]["connector"]


def test_nvme_hits_load_async_with_vllms_own_tokens(run) -> None:
    ref = run["rounds"][0]["tokens"]
    assert run["rounds"][0]["cached"] == [0] * len(PROMPTS), "round 0 is vLLM's own computation"
    assert run["rounds"][1]["tokens"] == ref
    assert run["rounds"][1]["cached"] == [hits(p) for p in PROMPTS]
    assert tier(run, 1, "nvme")["hit_tokens"] == sum(map(hits, PROMPTS)) and run["files"] > 0
    assert counts(run, 0)["async_loads"] == 0
    assert counts(run, 1)["async_loads"] == len(PROMPTS), "every NVMe hit went the async way"
    assert counts(run, 1)["loaded_tokens"] == sum(map(hits, PROMPTS)) and counts(run, 1)["failed_load_tokens"] == 0


def test_a_corrupted_nvme_file_under_an_async_load_is_a_failed_load_then_a_redis_hit(run) -> None:
    """Every NVMe file corrupted: each async load fails (reported to vLLM), NVMe drops the files,
    and vLLM's next lookup finds the chunks in Redis: a second async load, from Redis."""
    rnd = run["rounds"][2]
    assert rnd["tokens"] == run["rounds"][0]["tokens"], "never wrong KV"
    assert tier(run, 2, "nvme")["checksum_errors"] >= 1
    assert tier(run, 2, "nvme")["hit_tokens"] == tier(run, 1, "nvme")["hit_tokens"], "no NVMe hit counted"
    assert counts(run, 2)["failed_load_tokens"] == sum(map(hits, PROMPTS)), "every load failed, reported to vLLM"
    assert tier(run, 2, "redis")["hit_tokens"] - tier(run, 1, "redis")["hit_tokens"] == sum(map(hits, PROMPTS))
    assert rnd["cached"] == [hits(p) for p in PROMPTS], "the retry loaded every chunk from Redis"
    assert counts(run, 2)["async_loads"] - counts(run, 1)["async_loads"] == 2 * len(PROMPTS), \
        "a failed async load and the Redis one after it"


def test_the_chunks_read_from_redis_are_nvme_hits_again(run) -> None:
    """The Redis loads put the chunks back into NVMe (a load promotes what it read)."""
    rnd = run["rounds"][3]
    assert rnd["tokens"] == run["rounds"][0]["tokens"]
    assert rnd["cached"] == [hits(p) for p in PROMPTS]
    assert tier(run, 3, "nvme")["hit_tokens"] - tier(run, 2, "nvme")["hit_tokens"] == sum(map(hits, PROMPTS))
    assert counts(run, 3)["async_loads"] - counts(run, 2)["async_loads"] == len(PROMPTS)
    assert counts(run, 3)["failed_load_tokens"] == counts(run, 2)["failed_load_tokens"]
