"""``kvlayer bench vllm`` at small scale: real vLLM engines (CPU build), one per configuration.

The end-to-end run is marked ``slow`` (out of CI, which already runs vLLM's engine for the
connector's tests); the flag checks run in CI. The record holds every configuration asked for:
rows with positive times where it ran (kvlayer's hits counted by vLLM as cached, whole chunks,
the same greedy tokens as recompute's), an error where it cannot run here (LMCache not
installed); the ratios pair figures of the run.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvlayer.cli import main
from kvlayer.engine.presets import init_model

PNG = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.timeout(900)

if importlib.util.find_spec("vllm") is None:  # never imported here: see tests/connectors/test_vllm_v1.py
    pytest.skip("vLLM's CPU build is installed by scripts/setup.sh test", allow_module_level=True)


@pytest.mark.slow  # four vLLM engines, about 1.5 min on 2 cores: scripts/test.sh -m slow
def test_bench_vllm_measures_each_configuration_or_says_why_not(tmp_path, capsys) -> None:
    model = str(init_model("small", tmp_path / "m"))
    out, png = tmp_path / "vllm.json", tmp_path / "vllm.png"
    code = main(["bench", "vllm", "--model", model, "--home", str(tmp_path), "--lengths", "128,256",
                 "--configs", "recompute,prefix-cache,lmcache,cpu", "--repeat", "1", "--chunk-size", "64",
                 "--block-size", "32", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0 and png.read_bytes()[:8] == PNG
    record = json.loads(out.read_text())
    configs = record["configs"]
    assert list(configs) == ["recompute", "prefix-cache", "lmcache", "cpu"]
    if importlib.util.find_spec("lmcache") is None:
        assert configs["lmcache"]["error"] == "the lmcache package is not installed"
        assert "did not run" in printed
    for name in ("recompute", "prefix-cache", "cpu"):
        rows = configs[name]["rows"]
        assert [r["length"] for r in rows] == [128, 256]
        assert all(r["miss_s"] > 0 and r["hit_s"] > 0 for r in rows)
    assert [r["cached"] for r in configs["recompute"]["rows"]] == [0, 0]
    assert [r["cached"] for r in configs["prefix-cache"]["rows"]] == [128, 256], "vLLM's blocks of 32"
    assert [r["cached"] for r in configs["cpu"]["rows"]] == [128, 256], "kvlayer's whole chunks of 64"
    cpu = next(r for r in record["ratios"] if r["config"] == "cpu" and r["length"] == 256 and "over_prefix_cache" in r)
    assert cpu["over_prefix_cache"] == configs["cpu"]["rows"][1]["hit_s"] / configs["prefix-cache"]["rows"][1]["hit_s"]
    assert "cpu hit at 256 tokens:" in printed
    assert record["tokens_differ"] == [] and "every configuration's equal recompute's" in printed


def test_bench_vllm_rejects_bad_flags_in_one_line(tmp_path, capsys) -> None:
    assert main(["bench", "vllm", "--configs", "cpu,warp", "--home", str(tmp_path)]) == 2
    assert "unknown configuration 'warp'" in capsys.readouterr().err
    code = main(["bench", "vllm", "--chunk-size", "100", "--block-size", "32", "--home", str(tmp_path),
                 "--model", str(init_model("small", tmp_path / "m"))])
    assert code == 2 and "--chunk-size 100 must be a multiple of --block-size 32" in capsys.readouterr().err


def test_bench_vllm_with_two_tensor_parallel_ranks(tmp_path, capsys) -> None:
    """The only run of ``--tp``: kvlayer's CPU tier against recompute at TP=2, every rank loading
    its shard (the hit counted whole), with recompute's tokens (two engines: the other tiers at
    TP=2 are tests/connectors/test_vllm_tp.py's)."""
    model = str(init_model("small", tmp_path / "m"))  # 4 KV heads: 2 per rank
    out = tmp_path / "vllm.json"
    code = main(["bench", "vllm", "--model", model, "--home", str(tmp_path), "--lengths", "256", "--tp", "2",
                 "--configs", "recompute,cpu", "--repeat", "1", "--chunk-size", "64",
                 "--block-size", "32", "--json", str(out)])
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert code == 0 and record["settings"]["tp"] == 2 and "TP 2" in printed
    configs = record["configs"]
    assert all("error" not in configs[c] for c in configs), {c: configs[c].get("error") for c in configs}
    assert [configs[c]["rows"][0]["cached"] for c in ("recompute", "cpu")] == [0, 256]
    assert record["tokens_differ"] == []


def test_ranks_get_cores_of_their_own() -> None:
    from kvlayer.benchmarks.vllm_bench import rank_cores

    assert (rank_cores(2, 2), rank_cores(2, 16), rank_cores(4, 8), rank_cores(2, 1)) == ("0|1", "0-7|8-15",
                                                                                        "0-1|2-3|4-5|6-7", "0|0")
