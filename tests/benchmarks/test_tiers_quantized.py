"""``kvlayer bench tiers --quantizations``: rows per ``storage_quantization`` on nvme and redis with
their bytes per token, and the quality rows (TTFT, greedy agreement, largest logit difference
against no kvlayer) through the bundled engine, at tiny sizes (no timing thresholds).

The Redis rows need a ``redis-server`` binary; without one they are skipped with a note.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvlayer.cli import main
from kvlayer.serde import HEADER_SIZE

HAVE_REDIS = shutil.which("redis-server") is not None
TINY = ["--preset", "tiny", "--chunk-tokens", "16", "--chunks", "3", "--repeat", "1", "--engine-tokens", "0",
        "--compressions", "none"]
RAW = 2 * 2 * 16 * 2 * 16 * 4
"""A 16-token chunk of the tiny preset: 2 layers, K and V, 2 heads, head_dim 16, float32."""
QUANTIZED = 2 * 2 * 2 * (4 + 16 * 16)
"""Its int8/fp8 encoding: a float32 scale and 16 x 16 bytes per layer, K/V and head."""


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict, str]:
    out = tmp_path / "tiers.json"
    assert main(["bench", "tiers", *TINY, *argv, "--home", str(tmp_path / "home"), "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_quantized_rows_and_the_quality_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record, printed = run(tmp_path, capsys, "--quantizations", "none,int8,fp8", "--quality-prompts", "2",
                          "--quality-tokens", "4")
    (res,) = record["results"]
    rows = {(r["tier"], r["quantization"]): r for r in res["tiers"]}
    lower = ["nvme", "redis"] if HAVE_REDIS else ["nvme"]
    assert set(rows) == {("cpu", "none")} | {(t, q) for t in lower for q in ("none", "int8", "fp8")}
    assert rows["cpu", "none"]["stored_bytes_per_token"] == RAW / 16
    for tier in lower:
        assert rows[tier, "none"]["stored_bytes_per_token"] == (HEADER_SIZE + RAW) / 16
        for q in ("int8", "fp8"):
            r = rows[tier, q]
            assert r["stored_bytes_per_token"] == (HEADER_SIZE + QUANTIZED) / 16
            assert r["get_gib_s"] > 0 and r["put_gib_s"] > 0, "throughput counts the raw KV bytes"
    if HAVE_REDIS:
        assert rows["redis", "int8"]["memory_per_kv_byte"] < 0.5 < rows["redis", "none"]["memory_per_kv_byte"]
    header = next(line for line in printed.splitlines() if "quant" in line and "B/tok" in line and "mem/KV" in line)
    assert "comp" in header

    quality = record["quality"]
    assert (quality["prompts"], quality["generated_tokens"], quality["chunk_size"]) == (2, 4, 16)
    by_q = {r["quantization"]: r for r in quality["rows"]}
    assert list(by_q) == ["none", "int8", "fp8"]
    assert by_q["none"]["agreement"] == 1.0 and by_q["none"]["identical"] == 2
    for r in by_q.values():
        assert r["hit_tokens"] == 2 * 2 * 16 and r["hit_ttft_s"] > 0 and r["miss_ttft_s"] > 0
        assert 0.0 <= r["agreement"] <= 1.0 and r["max_logit_diff"] >= 0.0
    assert by_q["int8"]["max_logit_diff"] > 0.0, "lossy storage changes the logits"
    assert by_q["int8"]["stored_bytes_per_token"] < 0.3 * by_q["none"]["stored_bytes_per_token"]
    assert "NVMe hits with storage_quantization, 2 prompts" in printed
    assert all(c in printed for c in ("hit TTFT ms", "hit/exact", "agreement", "max |dlogit|"))


def test_no_quality_rows_for_exact_storage_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record, printed = run(tmp_path, capsys, "--tiers", "nvme")
    assert record["quality"] is None and "storage_quantization" not in printed
    assert [r["quantization"] for r in record["results"][0]["tiers"]] == ["none"]
    assert main(["bench", "tiers", "--quantizations", "int4", "--home", str(tmp_path / "home")]) == 2
