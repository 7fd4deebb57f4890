"""``kvlayer bench tiers`` at tiny sizes, through ``kvlayer.cli.main``: every tier's figures and
ceilings are recorded, positive, and their ratios consistent (no timing thresholds); the table,
notes and output paths are printed.

The Redis rows need a ``redis-server`` binary; without one the run notes that it skipped them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis

from kvlayer.benchmarks.redis_local import LocalRedis
from kvlayer.cli import main

HAVE_REDIS = shutil.which("redis-server") is not None
TINY = ["--preset", "tiny", "--chunk-tokens", "16,32", "--chunks", "3", "--repeat", "1"]


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
    return record


def test_every_tier_is_measured_next_to_its_ceiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = run(tmp_path, capsys)
    assert record["machine"]["cores"] >= 1 and record["preset"] == "tiny"
    assert record["model"]["preset"] == "tiny" and record["model"]["layers"] == 2, record["model"]
    assert record["settings"]["chunk_tokens"] == "16,32" and record["settings"]["repeat"] == 1
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
    assert not any("local redis-server" in n for n in record["notes"]), "the given server is used"
    heavy = [r for res in record["results"] for r in res["tiers"] if r["memory_per_kv_byte"] >= 1.05]
    assert len([n for n in record["notes"] if "size class" in n]) == len(heavy)
    assert main(["bench", "tiers", "--tiers", "tape", "--home", str(tmp_path / "home")]) == 2
