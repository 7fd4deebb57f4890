"""``kvlayer bench tiers`` at tiny sizes, through ``kvlayer.cli.main``: every tier's figures and
ceilings are recorded, positive, and their ratios consistent (no timing thresholds); so are the
KVCacheEngine rows (medians of the recorded runs, ratios from them, one goal line each); the
tables, notes and output paths are printed. Also the goal lines' wording and the alternation of
``tier_ceilings.alternated_times``.

The Redis rows need a ``redis-server`` binary; without one the run notes that it skipped them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest
import redis

from kvlayer.benchmarks.redis_local import LocalRedis
from kvlayer.benchmarks.tier_ceilings import GIB, alternated_times
from kvlayer.benchmarks.tiers import goal_lines
from kvlayer.cli import main

HAVE_REDIS = shutil.which("redis-server") is not None
TINY = ["--preset", "tiny", "--chunk-tokens", "16,32", "--chunks", "3", "--repeat", "1", "--engine-tokens", "80"]


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    """Run ``kvlayer bench tiers`` at tiny sizes; its record, after checking what it printed:
    the table and where the JSON and the PNG went."""
    out = tmp_path / "tiers.json"
    png = tmp_path / "tiers.png"
    assert main(["bench", "tiers", *TINY, *argv, "--home", str(tmp_path / "home"), "--json", str(out),
                 "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench tiers: 'tiny' preset, float32, 3 chunks per batch, best of 1" in printed
    header = next(line for line in printed.splitlines() if "tokens" in line and "mem/KV" in line)
    assert all(c in header for c in ("tier", "comp", "get GiB/s", "get ratio", "put ratio")), header
    assert f"wrote {out}" in printed.splitlines() and f"wrote {png}" in printed.splitlines()
    record = json.loads(out.read_text())
    for note in record["notes"]:
        assert f"note: {note}" in printed
    check_engine_rows(record, printed)
    return record


def check_engine_rows(record: dict, printed: str) -> None:
    """Each KVCacheEngine row's median, GiB/s and ratio follow from its recorded runs; a goal line each."""
    sections = [(res["chunk_tokens"], res["engine"]) for res in record["results"] if res["engine"]]
    assert record["goals"]["engine_ratio"] == 0.8
    for chunk, eng in sections:
        assert eng["tokens"] == 80 // chunk * chunk and eng["block_size"] == 16
        assert eng["kv_bytes"] == 2 * 2 * eng["tokens"] * 2 * 16 * 4  # tiny: 2 layers, 2 heads, dim 16
        for r in eng["rows"]:
            assert len(r["runs_s"]) == len(r["ceiling_runs_s"]) == record["repeat"]
            assert r["seconds"] == statistics.median(r["runs_s"]) > 0
            assert r["ceiling_seconds"] == min(r["ceiling_variants_s"].values())
            assert r["ceiling_seconds"] == r["ceiling_variants_s"][r["ceiling_variant"]]
            assert r["ceiling_seconds"] == statistics.median(r["ceiling_runs_s"])
            assert r["gib_s"] == pytest.approx(eng["kv_bytes"] / r["seconds"] / GIB)
            assert r["ceiling_gib_s"] == pytest.approx(eng["kv_bytes"] / r["ceiling_seconds"] / GIB)
            assert r["ratio"] == pytest.approx(r["gib_s"] / r["ceiling_gib_s"])
            assert r["goal_met"] == (r["ratio"] >= 0.8)
            assert r["ceiling"] in record["engine_ceilings"]
    lines = goal_lines(sections)
    assert len(lines) == sum(len(eng["rows"]) for _, eng in sections)
    assert all(line in printed.splitlines() for line in lines)
    if sections:
        assert "KVCacheEngine retrieve and durable store" in printed


def test_every_tier_is_measured_next_to_its_ceiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = run(tmp_path, capsys)
    assert record["machine"]["cores"] >= 1 and record["preset"] == "tiny"
    assert record["model"]["preset"] == "tiny" and record["model"]["layers"] == 2, record["model"]
    assert record["settings"]["chunk_tokens"] == [16, 32] and record["settings"]["repeat"] == 1
    assert set(record["ceilings"]) == {"memcpy", "file", "redis"}
    assert [r["chunk_tokens"] for r in record["results"]] == [16, 32]
    for res in record["results"]:
        assert res["chunk_bytes"] == 2 * 2 * res["chunk_tokens"] * 2 * 16 * 4  # tiny: 2 layers, 2 heads, dim 16
        rows = {(r["tier"], r["compression"]): r for r in res["tiers"]}
        expected = {("cpu", "none"), ("nvme", "none"), ("nvme", "lz4")}
        expected |= {("redis", "none"), ("redis", "lz4")} if HAVE_REDIS else set()
        assert set(rows) == expected
        for r in rows.values():
            for op in ("get", "put"):
                assert r[f"{op}_gib_s"] > 0 and r[f"{op}_ceiling_gib_s"] > 0
                assert r[f"{op}_ratio"] == pytest.approx(r[f"{op}_gib_s"] / r[f"{op}_ceiling_gib_s"])
            assert r["ceiling"] in res["ceilings_gib_s"]
        if HAVE_REDIS:
            for comp in ("none", "lz4"):
                assert rows["redis", comp]["memory_per_kv_byte"] >= 1.0, "Redis holds at least the bytes"
        engine = {(r["tier"], r["op"], r["reads"]): r for r in res["engine"]["rows"]}
        expected = {("cpu", "retrieve", "-"), ("cpu", "store", "-"), ("nvme", "retrieve", "warm"),
                    ("nvme", "store", "-")}
        expected |= {("nvme", "retrieve", "cold")} if hasattr(os, "posix_fadvise") else set()
        expected |= {("redis", "retrieve", "-"), ("redis", "store", "-")} if HAVE_REDIS else set()
        assert set(engine) == expected
        assert set(engine["cpu", "retrieve", "-"]["ceiling_variants_s"]) == {"float", "wide"}
        ceilings = {("cpu", "retrieve"): "index_copy", ("cpu", "store"): "index_select",
                    ("nvme", "retrieve"): "file_read", ("nvme", "store"): "file_write",
                    ("redis", "retrieve"): "redis_get", ("redis", "store"): "redis_set"}
        assert all(r["ceiling"] == ceilings[tier, op] for (tier, op, _), r in engine.items())
    assert not list((tmp_path / "home").rglob("*.kvc")), "the disk figures' files are removed"
    if not HAVE_REDIS:
        assert any("redis rows skipped" in n for n in record["notes"])


def test_a_given_redis_url_and_a_bad_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not HAVE_REDIS:
        pytest.skip("redis-server is not installed")
    with LocalRedis() as server:
        record = run(tmp_path, capsys, "--tiers", "redis", "--compressions", "none", "--redis-url", server.url)
        client = redis.Redis.from_url(server.url)
        assert client.dbsize() == 0, "the benchmark deletes what it wrote"
        client.close()
    assert [r["tier"] for res in record["results"] for r in res["tiers"]] == ["redis", "redis"]
    assert [(r["op"], r["ceiling"]) for res in record["results"] for r in res["engine"]["rows"]] == [
        ("retrieve", "redis_get"), ("store", "redis_set")] * 2
    assert not any("local redis-server" in n for n in record["notes"]), "the given server is used"
    heavy = [r for res in record["results"] for r in res["tiers"] if r["memory_per_kv_byte"] >= 1.05]
    assert len([n for n in record["notes"] if "size class" in n]) == len(heavy)
    assert main(["bench", "tiers", "--tiers", "tape", "--home", str(tmp_path / "home")]) == 2


def test_no_engine_rows_with_zero_engine_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = run(tmp_path, capsys, "--tiers", "cpu", "--engine-tokens", "0")
    assert [res["engine"] for res in record["results"]] == [None, None]
    assert "of ceiling (goal" not in capsys.readouterr().out
    assert main(["bench", "tiers", "--engine-tokens", "-1", "--home", str(tmp_path / "home")]) == 2


def test_goal_lines_name_the_reads_and_several_chunk_sizes() -> None:
    def rows(ratio: float) -> dict:
        return {"rows": [{"tier": "cpu", "op": "retrieve", "reads": "-", "ratio": ratio, "goal_met": ratio >= 0.8},
                         {"tier": "nvme", "op": "retrieve", "reads": "cold", "ratio": 0.5, "goal_met": False}]}

    assert goal_lines([(256, rows(0.834))]) == ["retrieve cpu 0.83 of ceiling (goal >= 0.80): met",
                                                "retrieve nvme cold 0.50 of ceiling (goal >= 0.80): NOT met"]
    assert goal_lines([(16, rows(0.8)), (64, rows(0.79))])[::2] == [
        "retrieve cpu (16-token chunks) 0.80 of ceiling (goal >= 0.80): met",
        "retrieve cpu (64-token chunks) 0.79 of ceiling (goal >= 0.80): NOT met"]


def test_alternated_times_take_turns_after_a_warm_up_round() -> None:
    calls: list[str] = []
    times = alternated_times({"ours": (lambda: calls.append("ours"), lambda: calls.append("clear")),
                              "ceiling": (lambda: calls.append("ceiling"), None)}, repeat=2)
    assert calls == ["clear", "ours", "ceiling"] * 3
    assert [len(v) for v in times.values()] == [2, 2] and all(t >= 0 for v in times.values() for t in v)
