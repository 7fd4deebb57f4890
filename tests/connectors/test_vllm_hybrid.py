"""kvlayer's vLLM connector on a hybrid model (full and sliding-window layers), vLLM's CPU build.

The model is the random ``small`` Mistral with a 256-token window whose ``layer_types`` make
layers 0 and 2 full and layers 1 and 3 sliding (vLLM's Llama/Mistral code reads per-layer
windows from ``layer_types``; its Qwen2 code does not). vLLM runs it with its hybrid KV cache
manager on: two KV-cache groups, one block table each, the sliding group's blocks before the
window vLLM's null block. kvlayer's connector implements ``SupportsHMA`` (docs/vllm.md, "Hybrid
models"), so vLLM keeps the manager on with kvlayer, and a hit loads each layer's KV through
its group's blocks, the window layers' only over the window. These tests pin that: the groups,
exact greedy tokens against vLLM alone with CPU-tier and NVMe-tier hits, the hit itself, and
the bytes each hit reads against the full KV.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvlayer.cache_groups import KVCacheGroups
from kvlayer.connectors.vllm_groups import block_tables
from kvlayer.connectors.vllm_scheduler import SchedulerSide
from kvlayer.engine.presets import PRESETS, init_model
from kvlayer.step import held_from
from tests.connectors.vllm_drive import drive

if importlib.util.find_spec("vllm") is None:  # vLLM is imported by the driver's processes only
    pytest.skip("vLLM's CPU build is installed by scripts/setup.sh test", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)
BLOCK = 128  # vLLM's CPU block size
CHUNK = 256  # kvlayer chunk: 2 vLLM blocks
WINDOW = 256
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
SMALL = PRESETS["small"]
LAYER_BYTES_PER_TOKEN = 2 * SMALL.num_kv_heads * SMALL.head_dim * 4  # keys and values, float32: 1 KiB
KV_BYTES_PER_TOKEN = SMALL.num_layers * LAYER_BYTES_PER_TOKEN  # every layer: 4 KiB


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


PROMPTS = prompts(7, [1100, 1500, 700])


def hits(prompt: list[int]) -> int:
    """The tokens kvlayer serves of ``prompt`` once stored: its full chunks, short of the last token."""
    usable = len(prompt) - 1
    return usable - usable % CHUNK


def window_aware_bytes(prompt: list[int], layer_types: list[str] = LAYER_TYPES) -> int:
    """What a hit on ``prompt`` reads: the full layers' KV of every hit token, the window layers'
    of the chunks holding the window's last ``WINDOW`` tokens before the hit's end."""
    end = hits(prompt)
    first = max(0, end - WINDOW + 1) // CHUNK * CHUNK
    full = sum(t == "full_attention" for t in layer_types)
    return (full * end + (len(layer_types) - full) * (end - first)) * LAYER_BYTES_PER_TOKEN


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-hybrid")


def mistral(folder: Path, layer_types: list[str]) -> str:
    init_model("small", folder, architecture="mistral", sliding_window=WINDOW)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = layer_types  # init_model writes none for Mistral (transformers ignores it)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def hybrid(work) -> str:
    return mistral(work / "hybrid", LAYER_TYPES)


def spec(model: str, kvlayer: dict[str, Any] | None, rounds: int, hybrid_manager: bool | None) -> dict[str, Any]:
    return {"model": model, "kvlayer": kvlayer, "block_size": BLOCK, "hybrid_manager": hybrid_manager,
            "rounds": [{"prompts": PROMPTS}] * rounds}


@pytest.fixture(scope="module")
def alone(hybrid, work) -> dict[str, Any]:
    """vLLM alone, its hybrid KV cache manager on: the reference tokens."""
    return drive(spec(hybrid, None, 1, True), work)


@pytest.fixture(scope="module")
def cpu_run(hybrid, work) -> dict[str, Any]:
    """kvlayer's CPU tier, vLLM deciding on its hybrid manager: round 0 stores, round 1 hits."""
    return drive(spec(hybrid, {"cpu_capacity": "256MiB", "chunk_size": CHUNK}, 2, None), work)


@pytest.fixture(scope="module")
def nvme_run(hybrid, work) -> dict[str, Any]:
    """kvlayer's NVMe tier alone (no CPU tier): round 0 writes files, round 1 hits them."""
    cfg = {"cpu_capacity": 0, "nvme_path": str(work / "nvme"), "nvme_capacity": "256MiB", "chunk_size": CHUNK}
    return drive(spec(hybrid, cfg, 2, None), work)


def groups(run: dict[str, Any]) -> list[tuple[str, int | None, int]]:
    assert "error" not in run, run.get("error")
    return [(g["spec"], g["window"], len(g["layers"])) for g in run["kv_cache_groups"]]


def test_vllm_keeps_its_hybrid_manager_on_with_kvlayer(alone, cpu_run, nvme_run) -> None:
    both = [("FullAttentionSpec", None, 2), ("SlidingWindowSpec", WINDOW, 2)]
    assert groups(alone) == both
    assert groups(cpu_run) == both and groups(nvme_run) == both, "kvlayer implements SupportsHMA"


@pytest.mark.parametrize("run_name, tier", [("cpu_run", "cpu"), ("nvme_run", "nvme")])
def test_hits_on_a_hybrid_give_vllms_own_tokens(request, alone, run_name: str, tier: str) -> None:
    run = request.getfixturevalue(run_name)
    assert "error" not in run, run.get("error")
    ref = alone["rounds"][0]["tokens"]
    first, second = run["rounds"]
    assert first["tokens"] == ref and second["tokens"] == ref
    assert first["cached"] == [0] * len(PROMPTS)
    assert second["cached"] == [hits(p) for p in PROMPTS], "each hit is kvlayer's (vLLM's prefix caching is off)"
    loaded = second["stats"]["connector"]["loaded_tokens"] - first["stats"]["connector"]["loaded_tokens"]
    assert loaded == sum(map(hits, PROMPTS))
    assert second["stats"]["tiers"][tier]["hit_tokens"] - first["stats"]["tiers"][tier]["hit_tokens"] > 0


@pytest.mark.parametrize("run_name, tier", [("cpu_run", "cpu"), ("nvme_run", "nvme")])
def test_each_hit_reads_the_window_layers_kv_only_over_the_window(request, run_name: str, tier: str) -> None:
    """The full layers' KV of every hit token, the window layers' of the last chunk before each
    hit's end (the window is one chunk): 0.64x the full KV of the hits."""
    run = request.getfixturevalue(run_name)
    before, after = (r["stats"]["tiers"][tier] for r in run["rounds"])
    read = after["get_bytes"] - before["get_bytes"]
    full = sum(map(hits, PROMPTS)) * KV_BYTES_PER_TOKEN
    assert read == sum(map(window_aware_bytes, PROMPTS)) < full
    print(f"kvlayer's {tier} tier read {read} bytes for {sum(map(hits, PROMPTS))} tokens of hits; "
          f"the full KV is {full} bytes ({read / full:.2f}x)")


MOSTLY_SLIDING = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]


def test_one_window_group_across_three_kv_cache_groups(work) -> None:
    """vLLM makes its groups the same size, so layer types [full, sliding, sliding, sliding]
    give 4 groups of one layer: kvlayer's one window object per chunk (layers 1-3) is copied
    through three block tables."""
    model = mistral(work / "mostly-sliding", MOSTLY_SLIDING)
    alone = drive(spec(model, None, 1, True), work)
    run = drive(spec(model, {"cpu_capacity": "256MiB", "chunk_size": CHUNK}, 2, None), work)
    assert groups(run) == groups(alone) == [("FullAttentionSpec", None, 1)] + [("SlidingWindowSpec", WINDOW, 1)] * 3
    first, second = run["rounds"]
    assert first["tokens"] == second["tokens"] == alone["rounds"][0]["tokens"]
    assert second["cached"] == [hits(p) for p in PROMPTS]
    read = second["stats"]["tiers"]["cpu"]["get_bytes"] - first["stats"]["tiers"]["cpu"]["get_bytes"]
    assert read == sum(window_aware_bytes(p, MOSTLY_SLIDING) for p in PROMPTS)


# --- the scheduler side's block tables per KV-cache group, on hand-made scheduler outputs ------
BS, SMALL_CHUNK = 4, 8


def _side(found: int, window: int) -> SchedulerSide:
    from kvlayer.config import KVLayerConfig

    class Lookups:
        def lookup(self, token_ids, salt, *, request_id="", start=0, limit=None):  # noqa: ANN001, ANN202
            n = min(found, limit if limit is not None else len(token_ids))
            return n, (0,) * (n // SMALL_CHUNK)

    groups = KVCacheGroups((0, 1, 0, 1), (None, window, None, window))
    return SchedulerSide(KVLayerConfig(chunk_size=SMALL_CHUNK, cpu_capacity=0), Lookups(), BS, groups)


def _request(rid: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(100, 100 + n)), num_prompt_tokens=n,
                           cache_salt=None)


def _output(new=(), cached=(), scheduled=None) -> SimpleNamespace:  # noqa: ANN001
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], new_block_ids=[
            b for _, b, _ in cached], num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled or {}, finished_req_ids=set(), preempted_req_ids=set())


def test_a_load_carries_every_groups_blocks_and_vllms_null_block_as_released() -> None:
    s = _side(found=16, window=8)
    r = _request("a", 20)
    assert s.matched(r, 0) == 16
    tables = ([1, 2, 3, 4, 5], [0, 0, 7, 8, 9])  # vLLM's null block before the window (16 - 8 + 1)
    s.allocated(r, tables[0], 16, tables)
    (load,) = s.build(_output(new=[("a", tables, 16)], scheduled={"a": 4})).loads
    assert load.block_ids == (1, 2, 3, 4) and load.groups == ((1, 2, 3, 4), (-1, -1, 7, 8))
    assert load.layer_groups == (0, 1, 0, 1)
    assert held_from(load.groups[1], BS) == 8, "the load writes the window group from token 8 on"
    with pytest.raises(ValueError, match="released block after a held one"):
        held_from((5, -1, 7), BS)


def test_a_chunk_whose_window_blocks_vllm_freed_is_not_saved() -> None:
    """vLLM frees a sliding group's blocks before each step's window (and may reuse them within
    the step): a chunk completed after that keeps no valid KV in them."""
    s = _side(found=0, window=2)
    r = _request("b", 16)
    assert s.matched(r, 0) == 0
    s.allocated(r, [1, 2, 3, 4], 0, ([1, 2, 3, 4], [11, 12, 13, 14]))
    step1 = s.build(_output(new=[("b", ([1, 2, 3, 4], [11, 12, 13, 14]), 0)], scheduled={"b": 6}))
    assert step1.saves == (), "no chunk complete yet"
    # step 2 computes [6, 16): vLLM freed the window group's block of tokens [0, 4) (6 - 2 + 1 = 5)
    (save,) = s.build(_output(cached=[("b", None, 6)], scheduled={"b": 10})).saves
    assert save.first == 8, "chunk [0, 8) is skipped, chunk [8, 16) saved"
    assert save.groups == ((1, 2, 3, 4), (-1, 12, 13, 14))
    assert block_tables([5, 0], ([5, 0], [0, 6])) == ([5, -1], [[5, -1], [-1, 6]])


def test_verification_on_a_hybrid_compares_each_groups_objects(alone, nvme_run, hybrid, work) -> None:
    """verify_fraction 1.0 with two KV-cache groups: every hit is recomputed by vLLM and each
    chunk object the NVMe files hold is compared with vLLM's fresh KV through its own group's
    blocks; all agree (the files are right), nothing is replaced, the tokens are vLLM's."""
    import shutil

    assert "error" not in nvme_run, nvme_run.get("error")
    folder = work / "nvme-verify"
    shutil.copytree(work / "nvme", folder)
    cfg = {"cpu_capacity": 0, "nvme_path": str(folder), "nvme_capacity": "256MiB", "chunk_size": CHUNK,
           "verify_fraction": 1.0}
    run = drive(spec(hybrid, cfg, 1, None), work)
    assert groups(run) == [("FullAttentionSpec", None, 2), ("SlidingWindowSpec", WINDOW, 2)]
    only, = run["rounds"]
    assert only["tokens"] == alone["rounds"][0]["tokens"]
    assert only["cached"] == [0] * len(PROMPTS), "a sampled hit is recomputed by vLLM"
    nvme = only["stats"]["tiers"]["nvme"]
    objects = len(list(folder.rglob("*.kvc")))
    assert nvme["verify_mismatches"] == 0 and nvme["hit_tokens"] == 0
    assert 0 < nvme["verified_hits"] <= objects, (nvme["verified_hits"], objects)


@pytest.fixture(scope="module")
def corrupted_run(hybrid, work, nvme_run) -> dict[str, Any]:
    """A new engine on ``nvme_run``'s files with every payload damaged: its first round's loads fail."""
    from kvlayer.serde import HEADER_SIZE

    assert "error" not in nvme_run, nvme_run.get("error")
    files = sorted((work / "nvme").rglob("*.kvc"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 5] ^= 0xFF
        path.write_bytes(bytes(data))
    cfg = {"cpu_capacity": 0, "nvme_path": str(work / "nvme"), "nvme_capacity": "256MiB", "chunk_size": CHUNK}
    return drive(spec(hybrid, cfg, 1, None), work)


def test_a_failed_load_on_a_hybrid_is_a_recompute_reported_per_request(alone, corrupted_run) -> None:
    """vLLM refuses block-level load errors with several KV-cache groups: kvlayer loads every hit
    asynchronously there and reports a failure per request (``failed_recving``); vLLM recomputes."""
    assert groups(corrupted_run) == [("FullAttentionSpec", None, 2), ("SlidingWindowSpec", WINDOW, 2)]
    only, = corrupted_run["rounds"]
    assert only["tokens"] == alone["rounds"][0]["tokens"], "the engine lives on, with vLLM's own tokens"
    connector = only["stats"]["connector"]
    assert connector["failed_load_tokens"] == sum(map(hits, PROMPTS)) and connector["loaded_tokens"] == 0
    assert connector["async_loads"] == len(PROMPTS)
    assert only["cached"] == [0] * len(PROMPTS), "recomputed from the start"
