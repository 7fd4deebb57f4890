"""kvlayer inside vLLM's own engine (vLLM's CPU build): ``KVLayerConnectorV1`` end to end.

Each engine runs in its own process (``tests/connectors/vllm_driver.py``, in-process vLLM mode
for speed; one test runs vLLM's default multiprocessing mode, where the scheduler and the
worker are separate processes). vLLM's own prefix caching is off unless a test says otherwise,
so every hit is kvlayer's. Greedy tokens with kvlayer must equal vLLM's without it. Most runs
also turn vLLM's KV-cache events on (vLLM's "null" publisher): the events vLLM's scheduler
publishes must name exactly the chunks that entered and left kvlayer's tiers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer.engine.presets import init_model
from tests.connectors.vllm_drive import ROOT, drive, result
from tests.redis_server import RedisServer, require_binary

# vLLM is only ever imported by the driver's processes: importing it here would swap triton for
# its placeholder (no CPU backend) in this process, under the Triton kernel tests' feet
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM's CPU build is installed by scripts/setup.sh test", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)  # a test may start several engines (6 s each; 30-60 s in multiprocessing mode)
CHUNK = 64  # kvlayer chunk: 2 vLLM blocks of 32


def prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    head = prefix or []
    return [head + [rng.randrange(3, 1000) for _ in range(n - len(head))] for n in lengths]


SHARED = prompts(1, [128])[0]
PROMPTS = prompts(2, [150, 200, 300]) + prompts(3, [170, 260], prefix=SHARED)
CONCURRENT = prompts(4, [140 + 5 * i for i in range(32)], prefix=SHARED)


def hits(prompt: list[int]) -> int:
    """The tokens kvlayer serves of ``prompt`` once stored: its full chunks, short of the last token."""
    usable = len(prompt) - 1
    return usable - usable % CHUNK


def tier(run: dict[str, Any], rnd: int, name: str) -> dict[str, Any]:
    return run["rounds"][rnd]["stats"]["tiers"][name]


# --- vLLM's KV-cache events (the driver's ``events``, ``keys`` and ``held``) -------------------
def event_hash(hex_digest: str) -> int:
    """A kvlayer chunk digest as vLLM's events carry it by default: its low 64 bits."""
    return int(hex_digest, 16) & ((1 << 64) - 1)


def chunks_of(run: dict[str, Any], rnd: int, prompts: list[list[int]]) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """kvlayer's full chunks of round ``rnd``'s ``prompts`` (its own keys): event hash -> (the
    previous chunk's, the chunk's tokens)."""
    out = {}
    for p, digests in zip(prompts, run["rounds"][rnd]["keys"], strict=True):
        hashes = [event_hash(d) for d in digests]
        assert len(hashes) == len(p) // CHUNK
        for i, h in enumerate(hashes):
            out[h] = (hashes[i - 1] if i else None, tuple(p[i * CHUNK : (i + 1) * CHUNK]))
    return out


def events(run: dict[str, Any], rounds: list[int], kind: str, medium: str) -> list[dict[str, Any]]:
    return [e for r in rounds for e in run["rounds"][r]["events"] if e["type"] == kind and e["medium"] == medium]


def stored(run: dict[str, Any], rounds: list[int], medium: str) -> list[tuple[int, tuple[int | None, tuple[int, ...]]]]:
    """Each chunk the rounds' ``BlockStored`` events name, in the form of ``chunks_of``, sorted."""
    out = []
    for e in events(run, rounds, "BlockStored", medium):
        assert e["block_size"] == CHUNK and len(e["tokens"]) == CHUNK * len(e["hashes"])
        for i, h in enumerate(e["hashes"]):
            out.append((h, (e["hashes"][i - 1] if i else e["parent"], tuple(e["tokens"][i * CHUNK : (i + 1) * CHUNK]))))
    return sorted(out, key=lambda c: c[0])


def replayed(run: dict[str, Any], medium: str) -> set[int]:
    """What a subscriber of the events thinks the tier holds after the run."""
    held: set[int] = set()
    for r in run["rounds"]:
        for e in (e for e in r["events"] if e["medium"] == medium):
            (held.update if e["type"] == "BlockStored" else held.difference_update)(e["hashes"])
    return held


def held(run: dict[str, Any], name: str) -> set[int]:
    return {event_hash(d) for d in run["rounds"][-1]["held"][name]}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def llama(work) -> str:
    return str(init_model("small", work / "llama", architecture="llama"))


@pytest.fixture(scope="module")
def baseline(llama, work) -> dict[str, Any]:
    """vLLM alone: the reference tokens."""
    return drive({"model": llama, "kvlayer": None, "rounds": [{"prompts": PROMPTS}, {"prompts": CONCURRENT},
                                                              {"prompts": PROMPTS, "max_tokens": 24}]}, work)


@pytest.fixture(scope="module")
def cpu_run(llama, work) -> dict[str, Any]:
    cfg = {"cpu_capacity": "256MiB", "chunk_size": CHUNK}
    salted = {"prompts": PROMPTS[:2], "salts": ["tenant-a", "tenant-a"]}
    return drive({"model": llama, "kvlayer": cfg, "kv_events": True, "rounds": [
        {"prompts": PROMPTS}, {"prompts": PROMPTS}, {"prompts": CONCURRENT}, salted, salted,
        {"prompts": PROMPTS, "reset": True}, {"prompts": PROMPTS}]}, work)


def test_cpu_tier_hits_give_vllms_own_tokens(baseline, cpu_run) -> None:
    ref = baseline["rounds"][0]["tokens"]
    first, second = cpu_run["rounds"][0], cpu_run["rounds"][1]
    assert first["tokens"] == ref and second["tokens"] == ref
    assert first["cached"] == [0] * len(PROMPTS), "vLLM's prefix caching is off: nothing cached at first"
    assert second["cached"] == [hits(p) for p in PROMPTS], "vLLM counts kvlayer's hits as cached tokens"
    assert tier(cpu_run, 1, "cpu")["hit_tokens"] - tier(cpu_run, 0, "cpu")["hit_tokens"] == sum(map(hits, PROMPTS))
    assert tier(cpu_run, 0, "cpu")["put_chunks"] > 0
    counts = [r["stats"]["connector"] for r in cpu_run["rounds"][:2]]  # what vLLM's connector stats report
    assert counts[1]["loaded_tokens"] - counts[0]["loaded_tokens"] == sum(map(hits, PROMPTS))
    assert counts[1]["failed_load_tokens"] == 0 and counts[0]["saved_chunks"] == tier(cpu_run, 0, "cpu")["put_chunks"]


def test_vllms_kv_cache_events_name_the_chunks_kvlayer_stored(cpu_run) -> None:
    first = chunks_of(cpu_run, 0, PROMPTS)
    assert stored(cpu_run, [0], "kvlayer:cpu") == sorted(first.items()), \
        "every chunk stored once, with its tokens, its parent and kvlayer's digest"
    assert stored(cpu_run, [1], "kvlayer:cpu") == [], "hits store nothing"
    concurrent = chunks_of(cpu_run, 2, CONCURRENT)
    assert stored(cpu_run, [2], "kvlayer:cpu") == sorted((h, c) for h, c in concurrent.items() if h not in first)
    salted = chunks_of(cpu_run, 3, PROMPTS[:2])
    assert not set(salted) & set(first), "a salt gives chunks keys of their own"
    assert stored(cpu_run, [3], "kvlayer:cpu") == sorted(salted.items())
    assert stored(cpu_run, [4], "kvlayer:cpu") == []
    assert {e["type"] for r in cpu_run["rounds"][:5] for e in r["events"]} == {"BlockStored"}, \
        "256 MiB: nothing evicted"
    assert replayed(cpu_run, "kvlayer:cpu") == held(cpu_run, "cpu")


def test_vllms_reset_prefix_cache_drops_kvlayers_cpu_tier_and_every_earlier_chunk(baseline, cpu_run) -> None:
    """``LLM.reset_prefix_cache(reset_connector=True)`` (as after a weight update) before round 5."""
    assert cpu_run["resets"] == [True]
    reset, again = cpu_run["rounds"][5], cpu_run["rounds"][6]
    assert reset["tokens"] == again["tokens"] == baseline["rounds"][0]["tokens"]
    assert reset["cached"] == [0] * len(PROMPTS), "nothing stored before the reset is found again"
    assert again["cached"] == [hits(p) for p in PROMPTS], "what is stored after it is"
    assert tier(cpu_run, 5, "cpu")["used_bytes"] == tier(cpu_run, 0, "cpu")["used_bytes"], \
        "the CPU tier holds only the prompts stored again (round 0's share), the rest dropped"
    before = {h for r in cpu_run["rounds"][:5] for e in r["events"] if e["type"] == "BlockStored" for h in e["hashes"]}
    removed = {h for e in reset["events"] if e["type"] == "BlockRemoved" for h in e["hashes"]}
    assert removed == before, "vLLM hears of every dropped chunk"
    now = {event_hash(d) for d in reset["held"]["cpu"]}
    assert len(now) == len(chunks_of(cpu_run, 0, PROMPTS)) and not now & before, "stored again under new keys"


def test_32_concurrent_requests_sharing_a_prefix(baseline, cpu_run) -> None:
    rnd = cpu_run["rounds"][2]
    assert rnd["tokens"] == baseline["rounds"][1]["tokens"]
    assert all(c >= len(SHARED) for c in rnd["cached"]), "the shared prefix, stored by the earlier rounds, hits"


def test_cache_salt_isolates_tenants(baseline, cpu_run) -> None:
    first, again = cpu_run["rounds"][3], cpu_run["rounds"][4]
    assert first["cached"] == [0, 0], "another tenant's chunks are not this tenant's"
    assert again["cached"] == [hits(p) for p in PROMPTS[:2]]
    assert first["tokens"] == again["tokens"] == baseline["rounds"][0]["tokens"][:2]


@pytest.fixture(scope="module")
def nvme_path(work) -> Path:
    return work / "nvme"


@pytest.fixture(scope="module")
def nvme_run(llama, work, nvme_path) -> dict[str, Any]:
    cfg = {"cpu_capacity": 0, "nvme_path": str(nvme_path), "nvme_capacity": "256MiB", "chunk_size": CHUNK}
    return drive({"model": llama, "kvlayer": cfg, "kv_events": True,
                  "rounds": [{"prompts": PROMPTS}, {"prompts": PROMPTS}]}, work)


def test_nvme_hits_are_exact_and_a_second_process_hits_at_once(baseline, nvme_run, llama, work, nvme_path) -> None:
    ref = baseline["rounds"][0]["tokens"]
    assert nvme_run["rounds"][0]["tokens"] == ref and nvme_run["rounds"][1]["tokens"] == ref
    assert nvme_run["rounds"][1]["cached"] == [hits(p) for p in PROMPTS]
    assert tier(nvme_run, 1, "nvme")["hit_tokens"] == sum(map(hits, PROMPTS))
    assert list(nvme_path.rglob("*.kvc")), "chunks are files on disk"
    cfg = {"cpu_capacity": 0, "nvme_path": str(nvme_path), "nvme_capacity": "256MiB", "chunk_size": CHUNK}
    second = drive({"model": llama, "kvlayer": cfg, "kv_events": True, "rounds": [{"prompts": PROMPTS}]}, work)
    assert second["rounds"][0]["tokens"] == ref
    assert second["rounds"][0]["cached"] == [hits(p) for p in PROMPTS], "its very first requests hit"
    # the background writes of round 0 reach the scheduler with a later step's output
    assert stored(nvme_run, [0, 1], "kvlayer:nvme") == sorted(chunks_of(nvme_run, 0, PROMPTS).items())
    assert replayed(nvme_run, "kvlayer:nvme") == held(nvme_run, "nvme")
    assert second["rounds"][0]["events"] == [], "files found at start-up are not announced (no tokens known)"


def test_verification_catches_a_wrong_kv_under_a_right_key(baseline, nvme_run, llama, work, nvme_path) -> None:
    """verify_fraction 1.0 in vLLM: the first prompt's chunk files are rewritten with another
    prompt's KV under their own keys (valid checksums); every hit is recomputed and compared, the
    wrong chunks are replaced on disk, and the next round verifies them as right."""
    import shutil

    from kvlayer.backends.nvme_files import chunk_path
    from kvlayer.keys import ChunkKey
    from kvlayer.serde import HEADER_SIZE, decode_header, decode_payload, encode_chunk

    folder = work / "nvme-verify"
    shutil.copytree(nvme_path, folder)
    keys = nvme_run["rounds"][0]["keys"]
    planted = {}
    for i, (mine, other) in enumerate(zip(keys[0], keys[1])):  # PROMPTS[0] takes PROMPTS[1]'s KV
        path, donor = (Path(chunk_path(str(folder), bytes.fromhex(d), i * CHUNK)) for d in (mine, other))
        head, data = decode_header(path.read_bytes()), donor.read_bytes()
        kv_of_other = torch.empty(head.shape, dtype=head.dtype)
        donor_head = decode_header(data)
        decode_payload(donor_head, data[HEADER_SIZE:], kv_of_other)
        key = ChunkKey(head.key, head.tokens_digest, i * CHUNK, (i + 1) * CHUNK)
        header, payload = encode_chunk(key, kv_of_other)
        path.write_bytes(header + bytes(payload))
        planted[path] = path.read_bytes()
    cfg = {"cpu_capacity": 0, "nvme_path": str(folder), "nvme_capacity": "256MiB", "chunk_size": CHUNK,
           "verify_fraction": 1.0}
    run = drive({"model": llama, "kvlayer": cfg, "rounds": [{"prompts": PROMPTS[:1]}, {"prompts": PROMPTS[:1]}]},
                work)
    ref = baseline["rounds"][0]["tokens"][:1]
    assert run["rounds"][0]["tokens"] == ref and run["rounds"][1]["tokens"] == ref
    assert run["rounds"][0]["cached"] == [0], "a sampled hit is recomputed by vLLM"
    first, second = tier(run, 0, "nvme"), tier(run, 1, "nvme")
    assert first["verify_mismatches"] == len(planted) and first["hit_tokens"] == 0
    assert all(p.read_bytes() != b for p, b in planted.items()), "the wrong chunks were replaced on disk"
    assert second["verify_mismatches"] == len(planted)
    assert second["verified_hits"] - first["verified_hits"] == len(planted), "the replacements are right"


def test_a_corrupted_chunk_file_is_a_miss_and_a_counter(baseline, nvme_run, llama, work, nvme_path) -> None:
    files = sorted(nvme_path.rglob("*.kvc"))
    for f in files:  # flip one byte in the middle of every chunk's KV
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    cfg = {"cpu_capacity": 0, "nvme_path": str(nvme_path), "nvme_capacity": "256MiB", "chunk_size": CHUNK}
    run = drive({"model": llama, "kvlayer": cfg, "kv_events": True, "rounds": [{"prompts": PROMPTS}]}, work)
    assert run["rounds"][0]["tokens"] == baseline["rounds"][0]["tokens"], "never wrong KV"
    assert tier(run, 0, "nvme")["checksum_errors"] >= 1
    assert tier(run, 0, "nvme")["hit_tokens"] == 0
    assert run["rounds"][0]["stats"]["connector"]["failed_load_tokens"] > 0, "reported to vLLM, which recomputed"
    removed = [h for e in events(run, [0], "BlockRemoved", "kvlayer:nvme") for h in e["hashes"]]
    chunks = chunks_of(run, 0, PROMPTS)
    assert removed and len(removed) == len(set(removed)), "each corrupt file dropped once"
    assert set(removed) <= set(chunks) and len(removed) <= tier(run, 0, "nvme")["checksum_errors"], \
        "a checksum error is counted per read (two prompts share a chunk), a file dropped once"
    assert set(stored(run, [0], "kvlayer:nvme")) <= set(chunks.items()), "only recomputed chunks, stored again"


def test_a_redis_killed_mid_run_costs_hits_not_tokens(baseline, llama, work) -> None:
    require_binary("redis-server")
    with RedisServer() as server:
        cfg = {"cpu_capacity": 0, "redis_url": server.url, "chunk_size": CHUNK, "tier_timeout_ms": 500}
        gate = work / "redis-killed"
        proc = drive({"model": llama, "kvlayer": cfg, "kv_events": True, "rounds": [
            {"prompts": PROMPTS}, {"prompts": PROMPTS}, {"prompts": PROMPTS, "wait_for": str(gate)},
            {"prompts": PROMPTS}]}, work, background=True)
        deadline = time.monotonic() + 300
        while not Path(str(gate) + ".ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the driver stopped before the gate"
            time.sleep(0.1)
        server.kill()
        gate.touch()
        run = result(proc)
    ref = baseline["rounds"][0]["tokens"]
    assert [r["tokens"] for r in run["rounds"]] == [ref] * 4
    assert run["rounds"][1]["cached"] == [hits(p) for p in PROMPTS], "Redis served hits while it lived"
    assert run["rounds"][2]["cached"] == [0] * len(PROMPTS) == run["rounds"][3]["cached"]
    assert stored(run, [0, 1], "kvlayer:redis") == sorted(chunks_of(run, 0, PROMPTS).items())
    counts = [r["stats"]["connector"]["saved_chunks"] for r in run["rounds"]]
    assert counts[3] > counts[1], "the chunks were saved again once Redis was gone"
    assert run["rounds"][2]["events"] == run["rounds"][3]["events"] == [], "a write that failed is no event"


def test_preemption_with_a_kv_cache_too_small_for_the_batch(baseline, llama, work) -> None:
    cfg = {"cpu_capacity": "256MiB", "chunk_size": CHUNK}
    run = drive({"model": llama, "kvlayer": cfg, "blocks": 24, "max_num_seqs": 8, "max_model_len": 512,
                 "rounds": [{"prompts": PROMPTS, "max_tokens": 24}, {"prompts": PROMPTS, "max_tokens": 24}]}, work)
    ref = baseline["rounds"][2]["tokens"]
    assert "error" not in run, run.get("error")
    assert run["rounds"][0]["tokens"] == ref and run["rounds"][1]["tokens"] == ref
    assert run["preemptions"] > 0, "the 24-block cache must preempt requests"
    assert tier(run, 1, "cpu")["hit_tokens"] > 0


def test_vllms_prefix_cache_first_kvlayer_for_what_it_misses(baseline, llama, work) -> None:
    """Also: a CPU tier of 4 chunks (of 13) evicts, and vLLM publishes its own events beside kvlayer's."""
    cfg = {"cpu_capacity": "1MiB", "chunk_size": CHUNK}
    run = drive({"model": llama, "kvlayer": cfg, "prefix_caching": True, "kv_events": True,
                 "rounds": [{"prompts": PROMPTS}, {"prompts": PROMPTS}]}, work)
    assert run["rounds"][0]["tokens"] == run["rounds"][1]["tokens"] == baseline["rounds"][0]["tokens"]
    assert all(c > 0 for c in run["rounds"][1]["cached"])
    assert tier(run, 1, "cpu")["hit_tokens"] == tier(run, 0, "cpu")["hit_tokens"], \
        "vLLM's own cache held every block: kvlayer loaded nothing"
    chunks = chunks_of(run, 0, PROMPTS)
    assert set(stored(run, [0, 1], "kvlayer:cpu")) <= set(chunks.items())
    assert len(stored(run, [0], "kvlayer:cpu")) < run["rounds"][0]["stats"]["connector"]["saved_chunks"], \
        "the chunks the full tier had no room for are not announced"
    assert events(run, [0, 1], "BlockRemoved", "kvlayer:cpu"), "the LRU evictions are"
    assert replayed(run, "kvlayer:cpu") == held(run, "cpu") and len(held(run, "cpu")) == 4
    assert run["rounds"][0]["vllm_events"] > 0, "vLLM's prefix cache's own events, in the same batches"


@pytest.mark.parametrize(("extra", "message"), [
    ({"cpu_capacity": "12XB"}, "cpu_capacity"),
    # each case starts an engine (20 s on 2 cores): CI keeps one, -m slow runs the others
    pytest.param({"no_such_key": 1}, "unknown kvlayer config key 'no_such_key'", marks=pytest.mark.slow),
    pytest.param({"chunk_size": 48}, "chunk_size 48 must be a multiple of vLLM's block_size 32",
                 marks=pytest.mark.slow),
])
def test_a_bad_extra_config_stops_the_start_up_with_kvlayers_message(llama, work, extra, message) -> None:
    run = drive({"model": llama, "kvlayer": extra, "rounds": []}, work)
    assert "error" in run and message in run["error"]


MP_PROMPTS = PROMPTS[:2]


@pytest.fixture(scope="module")
def mp_run(llama, work) -> dict[str, Any]:
    """vLLM's default mode, the way every vLLM server runs: the scheduler (engine core) and the
    worker in separate processes, so the lookups cross kvlayer's channel and the metadata is
    carried by vLLM. One engine, two short prompts, twice."""
    cfg = {"cpu_capacity": "256MiB", "chunk_size": CHUNK}
    endpoint = f"ipc://{work}/kv-events.sock"  # vLLM's ZMQ publisher, the driver its subscriber
    return drive({"model": llama, "kvlayer": cfg, "kv_events": endpoint,
                  "rounds": [{"prompts": MP_PROMPTS}, {"prompts": MP_PROMPTS}]}, work, mp=True)


def test_scheduler_and_worker_in_separate_processes(baseline, mp_run) -> None:
    ref = baseline["rounds"][0]["tokens"][: len(MP_PROMPTS)]
    assert [r["tokens"] for r in mp_run["rounds"]] == [ref, ref], "vLLM's own greedy tokens, miss then hit"
    assert mp_run["rounds"][0]["cached"] == [0] * len(MP_PROMPTS)
    assert mp_run["rounds"][1]["cached"] == [hits(p) for p in MP_PROMPTS], "the scheduler's lookup found the chunks"


def test_events_cross_from_the_worker_process(mp_run) -> None:
    chunks = {tuple(p[i * CHUNK : (i + 1) * CHUNK]) for p in MP_PROMPTS for i in range(len(p) // CHUNK)}
    got = stored(mp_run, [0], "kvlayer:cpu")  # the worker's events crossed into the engine-core process
    assert sorted(tokens for _, (_, tokens) in got) == sorted(chunks) and len({h for h, _ in got}) == len(chunks)
    assert mp_run["rounds"][1]["events"] == [], "hits store nothing"


def test_a_qwen2_model_with_qkv_biases(work) -> None:
    qwen = str(init_model("small", work / "qwen2", architecture="qwen2"))
    assert json.loads((Path(qwen) / "config.json").read_text())["model_type"] == "qwen2"
    alone = drive({"model": qwen, "kvlayer": None, "rounds": [{"prompts": PROMPTS}]}, work)
    cfg = {"cpu_capacity": "256MiB", "chunk_size": CHUNK}
    run = drive({"model": qwen, "kvlayer": cfg, "rounds": [{"prompts": PROMPTS}, {"prompts": PROMPTS}]}, work)
    assert run["rounds"][0]["tokens"] == run["rounds"][1]["tokens"] == alone["rounds"][0]["tokens"]
    assert run["rounds"][1]["cached"] == [hits(p) for p in PROMPTS]


def test_kvlayers_counts_aggregate_as_vllms_connector_stats() -> None:
    """vLLM sums the workers' ``KVLayerStats`` and logs ``reduce()`` (run where vLLM may be imported)."""
    code = ("import json; from kvlayer.connectors.vllm_v1 import KVLayerConnectorV1 as C, KVLayerStats as S; "
            "a = C.build_kv_connector_stats({'loaded_tokens': 3}); b = S(data={'loaded_tokens': 4, 'lookups': 1}); "
            "print(json.dumps([a.aggregate(b).reduce(), S().is_empty(), a.is_empty()]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [{"loaded_tokens": 7, "lookups": 1}, True, False]
