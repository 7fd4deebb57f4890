"""The whole hierarchy under the engine: exact tokens from each tier, restarts, failures."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.connectors.test_kvlayer_connector import GREEDY, C, conversation, make, run_chat


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    return [o.outputs[0].token_ids for o in run_chat(make(tiny_model_dir), conversation())]


def served(llm, tier: str) -> int:
    return llm.kv_stats()["tiers"][tier]["hit_tokens"]


def test_nvme_only(tiny_model_dir, baseline, tmp_path):
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(tmp_path)})
    outs = run_chat(llm, conversation())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    hits = sum(o.num_external_tokens for o in outs)
    assert hits > 0 and served(llm, "nvme") == hits
    assert list(tmp_path.rglob("*.kvc")), "chunks must be files on disk"
    llm.close()


def test_cpu_and_nvme_write_through_and_promotion(tiny_model_dir, baseline, tmp_path):
    kv = {"chunk_size": C, "cpu_capacity": "4MiB", "nvme_path": str(tmp_path)}
    llm = make(tiny_model_dir, kv)
    assert [o.outputs[0].token_ids for o in run_chat(llm, conversation())] == baseline
    llm.engine.connector.kv.flush()
    on_disk = len(list(tmp_path.rglob("*.kvc")))
    assert on_disk == llm.kv_stats()["tiers"]["cpu"]["put_chunks"], "every stored chunk is written through"
    llm.close()
    # A new engine: its CPU tier is empty, so the hits come from disk and are promoted.
    again = make(tiny_model_dir, kv)
    outs = run_chat(again, conversation())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert outs[0].num_external_tokens > 0, "the first turn now hits chunks of the earlier engine"
    stats = again.kv_stats()["tiers"]
    assert stats["nvme"]["hit_tokens"] > 0 and stats["cpu"]["promotions"] > 0
    again.close()


CHILD = textwrap.dedent("""
    import json, sys
    from tests.connectors.test_kvlayer_connector import GREEDY, C, conversation, make, run_chat
    llm = make(sys.argv[1], {"chunk_size": C, "cpu_capacity": 0, "nvme_path": sys.argv[2]})
    outs = run_chat(llm, conversation())
    llm.close()
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "external": [o.num_external_tokens for o in outs]}))
""")


def test_restart_in_another_process_hits_the_same_chunks(tiny_model_dir, baseline, tmp_path):
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", CHILD, tiny_model_dir, str(tmp_path)], capture_output=True,
                             text=True, check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert [tuple(t) for t in first["tokens"]] == baseline == [tuple(t) for t in second["tokens"]]
    assert first["external"][0] == 0
    assert second["external"][0] > 0, "the second process must hit what the first stored"


def test_corrupted_chunk_files_are_misses_and_tokens_stay_exact(tiny_model_dir, baseline, tmp_path):
    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(tmp_path)})
    msgs = conversation()
    history, outs = [], []
    for i, msg in enumerate(msgs):
        llm.engine.connector.kv.flush()  # NVMe-only: writes are in the background; let them land
        if i == 2:  # flip a byte in the payload of every chunk written so far
            for f in tmp_path.rglob("*.kvc"):
                data = bytearray(f.read_bytes())
                data[-5] ^= 0x40
                f.write_bytes(bytes(data))
        prompt = history + msg
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
        outs.append(out)
        history = prompt + list(out.outputs[0].token_ids)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    nvme = llm.kv_stats()["tiers"]["nvme"]
    assert nvme["backend"]["checksum_errors"] > 0
    assert outs[3].num_external_tokens > 0, "chunks rewritten after the corruption hit again"
    llm.close()


def test_disk_full_is_a_miss_not_a_crash(tiny_model_dir, baseline, tmp_path, monkeypatch):
    import errno

    from kvlayer.backends import nvme_files

    async def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    llm = make(tiny_model_dir, {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(tmp_path)})
    monkeypatch.setattr(nvme_files, "write_file", full)
    outs = run_chat(llm, conversation())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert sum(o.num_external_tokens for o in outs) == 0
    llm.close()
