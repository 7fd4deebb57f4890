"""``kvlayer bench peer`` without LMCache: its flags, its table and goals from a canned record, and
the one-line error when the LMCache venv cannot be built. The side-by-side run itself needs the
peer venv (minutes to build) and stays out of CI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvlayer.benchmarks import peer_lmcache
from kvlayer.cli import build_parser, main


def _record() -> dict:
    ms = 1e-3
    rows = [peer_lmcache.row("cpu", "retrieve", {"kvlayer": [10 * ms, 8 * ms, 12 * ms],
                                                 "lmcache": [16 * ms, 14 * ms, 17 * ms],
                                                 "scatter": [8 * ms, 8 * ms, 6 * ms]}),
            peer_lmcache.row("cpu", "store", {"kvlayer": [20 * ms] * 3, "lmcache": [40 * ms] * 3}),
            peer_lmcache.row("redis", "retrieve", {"kvlayer": [50 * ms] * 3, "lmcache": [150 * ms] * 3})]
    return {"lmcache": "0.5.6", "tokens": 2048, "kv_mib": 48.0, "repeat": 3, "rows": rows, "notes": [],
            "exact": {"cpu": {"kvlayer": True, "lmcache": True}, "redis": {"kvlayer": True, "lmcache": False}}}


def test_flags_parse_with_defaults_and_reject_an_unknown_tier(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "peer", "--tiers", "cpu,redis", "--venv", "/tmp/v"])
    assert (args.tiers, args.repeat, args.tokens, args.chunk_tokens, args.venv) == (["cpu", "redis"], 5, 2048, 256,
                                                                                    "/tmp/v")
    assert args.bench_module == "peer_lmcache"
    assert main(["bench", "peer", "--tiers", "cpu,gpu"]) == 2
    assert "unknown tier 'gpu'" in capsys.readouterr().err


def test_rows_take_medians_and_the_ratio_is_lmcaches_time_over_ours() -> None:
    cpu = _record()["rows"][0]
    assert cpu["kvlayer_s"] == pytest.approx(10e-3) and cpu["lmcache_s"] == pytest.approx(16e-3)
    assert cpu["speedup"] == pytest.approx(1.6)
    assert cpu["of_scatter"] == pytest.approx(0.8)
    assert min(cpu["kvlayer_runs_s"]) == pytest.approx(8e-3)
    assert "scatter_s" not in _record()["rows"][1]


def test_table_and_goal_lines_from_a_canned_record(capsys: pytest.CaptureFixture[str]) -> None:
    peer_lmcache.print_peer(_record())
    out = capsys.readouterr().out
    assert "cpu retrieve: 1.60x LMCache's (goal >= 1.50x): met" in out
    assert "cpu retrieve: 0.80 of the raw scatter (goal >= 0.70): met" in out
    assert "cpu store: 2.00x LMCache's (goal >= 1.50x): met" in out
    assert "redis retrieve: 3.00x LMCache's (goal >= 2.00x): met" in out
    assert "lmcache NOT" in out  # redis: LMCache's KV came back altered
    slower = _record()
    slower["rows"][0] = peer_lmcache.row("cpu", "retrieve", {"kvlayer": [17e-3], "lmcache": [14.5e-3],
                                                             "scatter": [7e-3]})
    lines = peer_lmcache.goal_lines(slower)
    assert "cpu retrieve: 0.85x LMCache's (goal >= 1.50x): NOT met" in lines
    assert "cpu retrieve: 0.41 of the raw scatter (goal >= 0.70): NOT met" in lines


def test_a_venv_that_cannot_be_built_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    said: list[str] = []
    with pytest.raises(peer_lmcache.PeerBuildError) as err:
        peer_lmcache.ensure_venv(blocker / "peer-venv", sys.executable, said.append)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"cannot build the LMCache venv at {blocker / 'peer-venv'}: create the venv failed:")
    assert said == [f"bench peer: create the venv: {sys.executable} -m venv {blocker / 'peer-venv'}"]


def test_the_cli_prints_that_error_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", "peer", "--venv", str(blocker / "v"), "--tiers", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlayer: error: cannot build the LMCache venv at ")
