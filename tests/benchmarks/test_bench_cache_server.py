"""``kvlayer bench cache-server`` at tiny sizes, through ``kvlayer.cli.main``: a real server
subprocess and real engine processes. The record's structure, the exactness checks of both
sides, medians and ratios that follow from the recorded runs (no timing thresholds), the
restarted engines' first retrieves being full hits from the server, the in-process CPU tier's
being a miss, and the server's accounting at the end (every lease back). Also a server that
cannot start, refused with its own message.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from kvlayer.benchmarks.cache_server_bench import goal_lines, server_process
from kvlayer.cli import main

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny preset: 2 layers x K and V x 2 heads x 16 dims x float32
TOKENS, CHUNK, RESTART_TOKENS, REPEAT, RESTARTS = 4096, 64, 256, 2, 2


def test_the_server_and_an_in_process_cpu_tier_side_by_side_and_across_restarts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cs.json"
    assert main(["bench", "cache-server", "--preset", "tiny", "--mib", "2", "--chunk-tokens", str(CHUNK),
                 "--restart-tokens", str(RESTART_TOKENS), "--repeat", str(REPEAT), "--restarts", str(RESTARTS),
                 "--home", str(tmp_path / "home"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    lines = printed.splitlines()
    assert f"wrote {out}" in lines
    assert "through the server vs an in-process CPU tier" in printed and "an engine restarted" in printed
    assert all(line in lines for line in goal_lines(record)) and len(goal_lines(record)) == 2
    assert record["model"]["preset"] == "tiny" and record["settings"]["restarts"] == RESTARTS
    assert record["goals"] == {"retrieve_ratio": 1.15, "restart_ratio": 1.2}

    ret = record["retrieve"]
    assert ret["tokens"] == TOKENS and ret["kv_bytes"] == TOKENS * TINY_BYTES_PER_TOKEN == 2 * 2**20
    for side in ("cache", "cpu"):  # each side gave the prefix back byte for byte, from its own tier only
        assert ret["checks"][side] == {"exact": True, "hit_tokens": TOKENS, "tiers": [side]}
    for op, r in ret["ops"].items():
        for side in ("cache", "cpu"):
            runs = r[side]["runs_s"]
            assert len(runs) == REPEAT and all(s > 0 for s in runs)
            assert r[side]["median_s"] == statistics.median(runs) and r[side]["best_s"] == min(runs)
        assert r["ratio"] == pytest.approx(r["cache"]["median_s"] / r["cpu"]["median_s"])
        assert r["best_ratio"] == pytest.approx(r["cache"]["best_s"] / r["cpu"]["best_s"])
        assert r["goal_met"] == (r["ratio"] <= 1.15 if op == "retrieve" else None)

    rs = record["restart"]
    cache, cpu = rs["cache"], rs["cpu"]
    assert rs["tokens"] == RESTART_TOKENS
    first = rs["processes"][1:]
    ready, cold = ([p for p in first if p["mode"] == mode] for mode in ("restart", "restart-cold"))
    assert len(ready) == len(cold) == RESTARTS and cache["first_tokens"] == [RESTART_TOKENS] * 2 * RESTARTS
    assert all(p["exact"] and p["first_hit_tokens"] == RESTART_TOKENS for p in first)
    assert cache["first"]["runs_s"] == [p["first_s"] for p in ready]
    assert cache["first_cold"]["runs_s"] == [p["first_s"] for p in cold]
    assert cache["ready"] and cache["ready_s"] == [p["ready_s"] for p in ready]  # connected and mapped within 2 s
    assert all(p["ready"] and 0 <= p["ready_s"] < 2 for p in ready)
    assert all(p["ready_s"] == 0 and not p["ready"] for p in cold)  # these retrieved at once
    assert len(cache["before"]["runs_s"]) == 2 * RESTARTS * REPEAT  # the warm hits of every process but the last
    assert cache["ratio"] == pytest.approx(cache["first"]["median_s"] / cache["before"]["median_s"])
    assert cache["cold_ratio"] == pytest.approx(cache["first_cold"]["median_s"] / cache["before"]["median_s"])
    assert cache["goal_met"] == (cache["ratio"] <= 1.2)
    assert cpu["first_tokens"] == 0 and len(cpu["before"]["runs_s"]) == REPEAT  # a restart empties it

    server = record["server"]
    chunks = TOKENS // CHUNK + RESTART_TOKENS // CHUNK
    assert server["chunks"] == chunks and server["used_bytes"] == chunks * CHUNK * TINY_BYTES_PER_TOKEN
    assert server["leases"] == 0 and server["reserved"] == 0 and server["evictions"] == 0
    assert server["used_bytes"] <= server["capacity_bytes"]


def test_a_server_that_cannot_start_is_refused_with_its_message(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="did not start.*cpu_capacity must be positive"), \
            server_process(str(tmp_path / "cache.sock"), 0):
        pass
    assert not (tmp_path / "cache.sock").exists()


def test_building_the_command_line_imports_no_torch() -> None:
    import subprocess

    code = "import sys, kvlayer.benchmarks.cache_server_bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
