"""``kvlayer bench bounds`` at tiny sizes, through ``kvlayer.cli.main``: one row per op under
the goal, each step timed (positive), the floors, ratios and verdicts following from the recorded
medians (no timing thresholds), the table and verdict lines printed; bad flags exit 2 before
any work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlayer.cli import main

TINY = ["--preset", "tiny", "--tokens", "200", "--chunk-tokens", "64", "--repeat", "2"]


def test_each_op_under_the_goal_is_split_into_its_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bounds.json", tmp_path / "bounds.png"
    assert main(["bench", "bounds", *TINY, "--home", str(tmp_path / "home"), "--json", str(out),
                 "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in printed
    record = json.loads(out.read_text())
    assert record["tokens"] == 192  # whole chunks of 64
    assert record["kv_bytes"] == 2 * 2 * 192 * 2 * 16 * 4  # tiny: 2 layers, K and V, 2 heads, dim 16, float32
    assert record["goal_ratio"] == 0.8
    rows = {(r["tier"], r["op"]): r for r in record["rows"]}
    assert list(rows) == [("cpu", "retrieve"), ("nvme", "retrieve"), ("nvme", "store")]
    assert list(rows["cpu", "retrieve"]["steps_s"]) == ["scatter_1", "scatter_n", "keys"]
    assert list(rows["nvme", "retrieve"]["steps_s"]) == ["read", "checksum", "scatter_1"]
    assert list(rows["nvme", "store"]["steps_s"]) == ["gather_1", "checksum", "write"]
    threads, memory = record["threads"], record["memory"]
    assert memory["copy_1_s"] > 0 and memory["copy_n_s"] > 0
    assert memory["speedup"] == pytest.approx(min(threads, max(1, memory["copy_1_s"] / memory["copy_n_s"])))
    for (tier, op), r in rows.items():
        steps = r["steps_s"]
        assert r["ceiling_s"] > 0 and r["ours_s"] > 0 and all(v > 0 for v in steps.values())
        if tier == "cpu":
            assert r["floor_s"] == pytest.approx(min(steps["scatter_1"], steps["scatter_n"]) + steps["keys"])
            assert r["fixed_s"] == pytest.approx(r["ours_s"] - steps["scatter_n"])
        else:
            longest, total = max(steps.values()), sum(steps.values())
            assert r["floor_s"] == pytest.approx(max(longest, total / memory["speedup"]))
            assert r["cores_floor_s"] == pytest.approx(max(longest, total / threads))
            assert r["cores_floor_s"] <= r["floor_s"]
        assert r["ratio"] == pytest.approx(r["ceiling_s"] / r["ours_s"])
        assert r["best_ratio"] == pytest.approx(r["ceiling_s"] / r["floor_s"])
        assert r["goal_reachable"] == (r["best_ratio"] >= 0.8)
        verdict = "reachable" if r["goal_reachable"] else "out of reach on this machine"
        assert f"{tier} {op}: best ratio {r['best_ratio']:.2f} against the goal 0.8: {verdict}" in printed
    assert f"the nvme floors spread their steps {memory['speedup']:.2f}x" in printed
    assert "bench bounds: 192 tokens" in printed and "medians of 2 alternated rounds" in printed
    assert f"wrote {out}" in printed
    assert not list((tmp_path / "home").glob("bounds-*"))  # the tier's files went with the run


@pytest.mark.parametrize("flag", [["--tokens", "0"], ["--chunk-tokens", "x"], ["--preset", "huge"]])
def test_bad_flags_exit_2_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]) -> None:
    assert main(["bench", "bounds", *flag, "--home", str(tmp_path / "home")]) == 2
    assert not (tmp_path / "home").exists()
    assert capsys.readouterr().err.strip()
