"""Engines as clients of one server (real processes): sharing, isolation, a dying server, bad bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlayer import KVCacheEngine
from kvlayer.cacheserver.arena import shm_dir
from kvlayer.engine import LLM, SamplingParams

from . import worker
from .conftest import ROOT

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run_worker(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    out = subprocess.run([sys.executable, "-m", "tests.cacheserver.worker", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_share_chunks_exactly_and_salts_stay_apart(server, tmp_path: Path):
    assert run_worker("store", server.socket_path, "")["tokens"] == 5
    got = run_worker("retrieve", server.socket_path, "", str(tmp_path / "b.bin"))
    assert got == {"tokens": 40, "held": 0}  # every lease given back by the end of the retrieve
    expected = worker.rows(worker.kv_caches(worker.SEED), worker.slots(40, 0))
    assert (tmp_path / "b.bin").read_bytes() == expected
    assert run_worker("retrieve", server.socket_path, "other-tenant", str(tmp_path / "c.bin"))["tokens"] == 0
    stats = server.wait_stats(lambda s: s.leases == 0)
    assert stats.chunks == 5 and stats.reserved == 0


def test_bundled_engines_in_two_processes_hit_each_other(server, tiny_model_dir, reference):
    want = list(reference.generate([{"prompt_token_ids": worker.PROMPT}], GREEDY)[0].outputs[0].token_ids)
    first = run_worker("generate", server.socket_path, tiny_model_dir)
    second = run_worker("generate", server.socket_path, tiny_model_dir)
    assert first == {"tokens": want, "external": 0}
    assert second == {"tokens": want, "external": 64}  # 4 chunks of 16 from the other process's store


def _llm(model: str, sock: str) -> LLM:
    return LLM(model, num_gpu_blocks=64, dtype="float32", kv_config={**worker.kv_config(sock), "chunk_size": 16})


def _answer(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    assert out.outputs[0].finish_reason == "length", out
    return list(out.outputs[0].token_ids), out.num_external_tokens


def test_a_killed_server_means_misses_then_hits_once_it_is_back(server, tiny_model_dir, reference):
    prompts = [list(range(5 + i, 70 + i)) for i in range(3)]
    want = [list(o.outputs[0].token_ids) for o in reference.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       GREEDY)]
    with _llm(tiny_model_dir, server.socket_path) as llm:
        assert _answer(llm, prompts[0]) == (want[0], 0)
        assert _answer(llm, prompts[0]) == (want[0], 64)
        engine = llm.engine
        llm.reset_prefix_cache()
        rid = engine.add_request({"prompt_token_ids": prompts[1]}, GREEDY)
        outs = engine.step()  # the prefill, its chunks saved to the server
        server.kill()  # mid-request: the decode steps and every later request go on without it
        while engine.has_unfinished_requests():
            outs += engine.step()
        final = [o for o in outs if o.request_id == rid and o.finished][0]
        assert list(final.outputs[0].token_ids) == want[1]
        for _ in range(3):  # misses, exact tokens, no failed request
            assert _answer(llm, prompts[0]) == (want[0], 0)
        assert llm.kv_stats()["tiers"]["cache"]["health"]["healthy"] is False

        old = sorted(shm_dir().glob(f"kvlayer-cache-{os.getuid()}-*"))
        server.start()  # a new epoch on the same socket: the dead server's arena file is removed
        with server.client() as c:
            stem = Path(c.welcome.path).name.rsplit("-", 1)[0]
            assert [p for p in old if p.name.startswith(stem)] != []  # SIGKILL left it behind
            assert sorted(shm_dir().glob(f"{stem}-*")) == [Path(c.welcome.path)]
        hits = []
        for _ in range(40):  # the tier is retried after its backoff (100-200 ms here)
            tokens, external = _answer(llm, prompts[2])
            assert tokens == want[2]
            hits.append(external)
            if external:
                break
            time.sleep(0.05)
        assert hits[-1] == 64, hits
        assert llm.kv_stats()["tiers"]["cache"]["backend"]["connects"] == 2


def _kv(sock: str, **extra: object) -> KVCacheEngine:
    return KVCacheEngine({**worker.kv_config(sock), **extra}, worker.layout(), model_name="m", model_fingerprint="f")


def test_a_chunk_damaged_in_the_arena_is_a_miss(unscrubbed):
    """The client's own hash (``cache_server_verify: first``) finds a chunk damaged after the
    server sealed it (a server that never re-scrubs, so the client is the one to find it)."""
    server = unscrubbed
    with _kv(server.socket_path, cache_server_verify="first") as kv:
        assert kv.store(worker.TOKENS, worker.kv_caches(1), worker.slots(40, 0)) == 5
        server.wait_stats(lambda s: s.sealed == 5)
        with server.client() as c:
            path, offset = c.welcome.path, c.lease([worker_key(kv, 2)])[0].offset
        with open(path, "r+b") as f:  # a stray write into the third chunk's bytes
            f.seek(offset + 100)
            f.write(b"\xff\xfe")
        dst = worker.kv_caches(None)
        assert kv.retrieve(worker.TOKENS, dst, worker.slots(40, 20)) == 16  # the first two chunks only
        stats = kv.stats()["tiers"]["cache"]
        assert stats["backend"]["checksum_errors"] == 1 and stats["backend"]["held"] == 0
        assert worker.rows(dst, worker.slots(16, 20)) == worker.rows(worker.kv_caches(1), worker.slots(16, 0))


def worker_key(kv: KVCacheEngine, i: int):
    from kvlayer.cacheserver.protocol import Key

    key = kv.keys(worker.TOKENS)[i]
    return Key(key.digest, key.tokens_digest)


@pytest.mark.parametrize("case", ["no server", "wrong token"])
def test_an_unreachable_server_is_a_failed_tier_not_an_error(sock_path, case):
    from .conftest import ServerProcess

    proc = ServerProcess(sock_path, "1MiB", token="right").start() if case == "wrong token" else None
    try:
        with _kv(sock_path, cache_server_token="wrong" if proc else None, tier_timeout_ms=500) as kv:
            kv.store(worker.TOKENS, worker.kv_caches(1), worker.slots(40, 0))  # no exception: nowhere to go
            assert kv.lookup(worker.TOKENS).num_tokens == 0
            assert kv.retrieve(worker.TOKENS, worker.kv_caches(None), worker.slots(40, 20)) == 0
            assert kv.stats()["tiers"]["cache"]["errors"] >= 1
    finally:
        if proc is not None:
            proc.stop()


def test_the_settings_are_config_keys():
    from kvlayer import ConfigError, KVLayerConfig

    config = KVLayerConfig.load({"cache_server": "/run/kv.sock"}, env={"KVLAYER_CACHE_SERVER_TOKEN": "t"})
    assert config.tiers["cache"] == {"server": "/run/kv.sock", "server_token": "t", "server_verify": "server",
                                     "salt_quota": None,
                                     "socket_group": None, "metrics_port": 0}
    assert KVLayerConfig.from_dict({"tiers": {"cache": {"salt_quota": 0.25}}}).tiers["cache"]["salt_quota"] == "0.25"
    with pytest.raises(ConfigError, match="fraction in"):
        KVLayerConfig(cache_salt_quota="1.5")
    assert KVLayerConfig().tiers["cache"].enabled is False
    with pytest.raises(ConfigError, match="cache_server"):
        KVLayerConfig(cache_server="/" + "x" * 200)
    with pytest.raises(ConfigError, match="cache_server_verify must be one of server, first, always"):
        KVLayerConfig(cache_server_verify="never")
