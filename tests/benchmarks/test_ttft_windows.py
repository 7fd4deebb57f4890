"""``kvlayer bench ttft --window-aware both`` on sliding-window models: window-aware loads next to
full-KV loads in one run, with the KV bytes each hit loaded (measured from ``kv_stats()``'s
``loaded_tokens``; no timing thresholds).

The tiny preset keeps 256 bytes of KV per token and layer (float32, 2 KV heads of 16). A 128-token
prefix in 32-token chunks with a 32-token window: a query at 128 reads back to 97, so the window
layers load the chunk [96, 128) only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlayer.cli import main
from kvlayer.engine.presets import init_model

LAYER_BYTES = 256  # one token of one layer of the tiny preset


@pytest.mark.parametrize(("arch", "extra", "aware_bytes"), [
    ("mistral", {}, 32 * 2 * LAYER_BYTES),  # both layers slide: the last chunk of both
    ("qwen2", {"max_window_layers": 1}, (128 + 32) * LAYER_BYTES),  # layer 0 full, layer 1 slides
])
def test_window_aware_hits_load_the_window_and_full_kv_loads_all(tmp_path: Path, capsys, arch: str,
                                                                 extra: dict, aware_bytes: int) -> None:
    model = init_model("tiny", tmp_path / arch, seed=3, architecture=arch, sliding_window=32, **extra)
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--model", str(model), "--home", str(tmp_path / "home"), "--configs",
                 "recompute,cpu", "--lengths", "128", "--suffix", "16", "--chunk-size", "32", "--layerwise", "off",
                 "--window-aware", "both", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["model"]["layer_windows"] == ([32, 32] if arch == "mistral" else [None, 32])
    aware, full = rec["variants"]["cpu wa=on"], rec["variants"]["cpu wa=off"]
    assert (aware["window_aware"], full["window_aware"]) == (True, False)
    assert full["kv_config"]["window_aware"] is False and "window_aware" not in aware["kv_config"]
    (row,), (frow,) = aware["by_length"], full["by_length"]
    assert (row["loaded_bytes"], frow["loaded_bytes"]) == (aware_bytes, 128 * 2 * LAYER_BYTES)
    base = rec["baselines"]["128"]
    assert row["hit_token"] == frow["hit_token"] == base["cold_token"]  # both exact
    (pair,) = rec["window_aware"]
    assert (pair["config"], pair["prefix"], pair["aware_bytes"], pair["full_bytes"]) == (
        "cpu", 128, aware_bytes, 128 * 2 * LAYER_BYTES)
    assert pair["bytes_ratio"] == pytest.approx(aware_bytes / (128 * 2 * LAYER_BYTES))
    assert pair["ttft_ratio"] == pytest.approx(row["hit_s"] / frow["hit_s"])
    assert "window-aware loads against full-KV loads" in capsys.readouterr().out


def test_window_aware_is_checked_before_any_work(tmp_path: Path, capsys) -> None:
    assert main(["bench", "ttft", "--window-aware", "maybe", "--home", str(tmp_path)]) == 2
    assert "argument --window-aware: invalid choice: 'maybe'" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()
