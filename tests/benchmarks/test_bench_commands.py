"""``kvlayer bench ttft|multi-round-qa|long-doc-qa|miss-overhead|engine`` at tiny scale, through
``kvlayer.cli.main``.

Each run writes JSON and a PNG; the tests check the record (machine, model and settings; every
configuration present, positive times, hit rates within [0, 1], kvlayer configurations with
hits), the PNG signature, and what the run printed: its table, its verdict lines (crossovers,
goals) agreeing with the record, and where the files went. The ``redis`` configuration joins
when a ``redis-server`` binary is installed.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kvlayer.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
HAVE_REDIS = shutil.which("redis-server") is not None
KV_CONFIGS = ["cpu", "cpu+nvme", "nvme"] + (["redis"] if HAVE_REDIS else [])
SERVED_BY = {"cpu": "cpu", "cpu+nvme": "nvme", "nvme": "nvme", "redis": "redis"}
"""The tier a hit must come from (``cpu+nvme`` is measured with the CPU tier emptied)."""


def _run(tmp_path, capsys, *argv: str) -> tuple[dict, str]:
    """Run ``kvlayer bench *argv`` with ``--json`` and ``--plot``; (the record, what it printed)."""
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    code = main(["bench", *argv, "--home", str(tmp_path / "home"), "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0
    assert png.read_bytes()[:8] == PNG
    lines = printed.splitlines()
    assert f"wrote {out}" in lines and f"wrote {png}" in lines
    return json.loads(out.read_text()), printed


def _check_record(record: dict, model: str) -> None:
    assert {"machine", "model", "settings"} <= set(record)
    assert record["machine"]["torch"] and record["machine"]["cores"] >= 1
    assert record["model"]["path"] == model and record["model"]["kv_bytes_per_token"] > 0
    assert record["model"]["name"] and record["model"]["layers"] > 0
    assert record["settings"]["device"] == "cpu" and record["settings"]["model"] == model


def _check_table(printed: str, title: str, columns: list[str]) -> None:
    """The table's title and column headers were printed (headers are short and never wrap)."""
    assert title in printed
    header = next(line for line in printed.splitlines() if columns[0] in line and columns[-1] in line)
    assert all(c in header for c in columns), header


def _crossover_lines(printed: str) -> list[str]:
    """The lines under the crossover heading, one per kvlayer configuration measured."""
    lines = printed.splitlines()
    start = lines.index("crossover: the cached prefix length below which recomputing is cheaper than loading")
    return [line for line in lines[start + 1:] if line.startswith("  ")]


def test_ttft_measures_every_tier_both_loading_modes_and_partial_hits(tiny_model_dir, tmp_path, capsys):
    configs = ",".join(["recompute", "engine", *KV_CONFIGS])
    rec, printed = _run(tmp_path, capsys, "ttft", "--model", tiny_model_dir, "--lengths", "128,256", "--suffix", "8",
                        "--chunk-size", "64", "--configs", configs, "--layerwise", "both", "--partial")
    _check_record(rec, tiny_model_dir)
    _check_table(printed, f"bench ttft: {rec['model']['name']} (2 layers)",
                 ["prefix", "config", "TTFT s", "speedup", "served by"])
    assert "partial hit: half of the prompt cached" in printed and "layer-by-layer loading" in printed
    assert _crossover_lines(printed) == [f"  {label}: {v['crossover']['text']} tokens"
                                         for label, v in rec["variants"].items()]
    assert rec["lengths"] == [128, 256]
    for b in rec["baselines"].values():
        assert b["cold_s"] > 0 and b["suffix_s"] > 0 and b["floor_s"] > 0
        assert b["partial_cold_s"] > 0 and b["partial_engine_s"] > 0
    assert rec["ceilings_gib_s"]["memcpy"] > 0 and all(v > 0 for v in rec["ceilings_gib_s"].values())
    assert ("redis_get" in rec["ceilings_gib_s"]) == HAVE_REDIS
    assert sorted(rec["variants"]) == sorted(f"{c} lw={m}" for c in KV_CONFIGS for m in ("on", "off"))
    for label, v in rec["variants"].items():
        tier = SERVED_BY[v["config"]]
        assert v["layerwise"] is label.endswith("on")
        assert v["crossover"]["kind"] in ("below", "between", "never")
        for row in v["by_length"]:
            assert row["miss_s"] > 0 and row["hit_s"] > 0 and row["speedup"] > 0
            # each hit's floor: its bytes over its own tier's raw ceiling (NVMe: cold reads,
            # Redis: GETs, CPU: copies) plus the suffix's compute
            ceiling = {"cpu": "memcpy", "nvme": "nvme_cold", "cpu+nvme": "nvme_cold",
                       "redis": "redis_get"}[v["config"]]
            gib_s = rec["ceilings_gib_s"].get(ceiling, rec["ceilings_gib_s"]["memcpy"])
            floor = row["cached"] * rec["model"]["kv_bytes_per_token"] / (gib_s * 2**30)
            assert row["floor_s"] == pytest.approx(floor + rec["baselines"][str(row["prefix"])]["suffix_s"])
            assert row["hit_over_floor"] == pytest.approx(row["hit_s"] / row["floor_s"])
            assert row["hit_tiers"] == {tier: row["cached"]}, label
            assert row["load_s"] is not None and row["load_s"] > 0
            assert row["partial_cached"] == row["prefix"] // 2
            assert row["partial_tiers"] == {tier: row["partial_cached"]}, label
    assert {o["config"] for o in rec["layerwise"]} == set(KV_CONFIGS)
    assert {o["case"] for o in rec["layerwise"]} == {"full", "partial"}
    assert all(o["ratio_max"] > 0 and o["ratio_sum"] > 0 for o in rec["layerwise"])


def test_ttft_with_one_loading_mode_names_configs_plainly(tiny_model_dir, tmp_path, capsys):
    rec, printed = _run(tmp_path, capsys, "ttft", "--model", tiny_model_dir, "--lengths", "64", "--suffix", "4",
                        "--chunk-size", "32", "--configs", "recompute,cpu", "--layerwise", "off")
    assert list(rec["variants"]) == ["cpu"] and rec["variants"]["cpu"]["layerwise"] is False
    assert rec["layerwise"] == []
    assert _crossover_lines(printed) == [f"  cpu: {rec['variants']['cpu']['crossover']['text']} tokens"]
    assert "layer-by-layer loading" not in printed and "partial hit" not in printed


def test_ttft_verify_runs_each_config_verified_beside_it(tiny_model_dir, tmp_path, capsys):
    rec, printed = _run(tmp_path, capsys, "ttft", "--model", tiny_model_dir, "--lengths", "64", "--suffix", "4",
                        "--chunk-size", "32", "--configs", "recompute,nvme", "--layerwise", "on", "--verify")
    assert list(rec["variants"]) == ["nvme", "nvme verify"]
    plain, verified = rec["variants"]["nvme"], rec["variants"]["nvme verify"]
    assert (plain["verify_fraction"], verified["verify_fraction"]) == (0.0, 1.0)
    assert plain["by_length"][0]["hit_tiers"] == {"nvme": 64}
    assert verified["by_length"][0]["hit_tiers"] == {}, "a verified hit is recomputed, not loaded"
    assert verified["verified"] == {"verified_hits": 2, "verify_mismatches": 0}  # one hit of 2 chunks
    assert plain["verified"] == {"verified_hits": 0, "verify_mismatches": 0}
    assert verified["by_length"][0]["first_token_matches"] is True
    [row] = rec["verification"]
    assert row["config"] == "nvme verify" and row["hit_s"] == plain["by_length"][0]["hit_s"]
    assert row["mean_at_0.1_s"] == pytest.approx(0.9 * row["hit_s"] + 0.1 * row["verified_s"])
    assert "hit verification: every hit recomputed and compared" in printed
    assert "nvme verify: verified_hits 2, verify_mismatches 0" in printed


def _check_serving(results: list[dict], names: list[str], must_hit: list[str]) -> dict[str, dict]:
    by = {r["config"]: r for r in results}
    assert list(by) == names
    for name, r in by.items():
        assert r["requests"] > 0 and r["span_s"] > 0
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["ttft_s"]["mean"] > 0
        assert r["generated_tok_per_s"] > 0 and r["request_per_s"] > 0
        assert all(0.0 <= v <= 1.0 for v in r["hit_rate"].values()), name
        assert 0.0 <= r["recomputed"] <= 1.0
        if r["kvlayer"] is not None:
            assert r["hit_rate"]["kvlayer"] > 0 or name not in must_hit, name
            tiers = sum(v for k, v in r["hit_rate"].items() if k not in ("engine", "kvlayer"))
            assert tiers == pytest.approx(r["hit_rate"]["kvlayer"])
    assert by["recompute"]["hit_rate"] == {"engine": 0.0, "kvlayer": 0.0}
    return by


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def test_multi_round_qa_compares_configs_over_a_working_set_beyond_the_engine(tiny_model_dir, tmp_path, capsys):
    names = ["recompute", "engine", *KV_CONFIGS]
    rec, printed = _run(tmp_path, capsys, "multi-round-qa", "--model", tiny_model_dir, "--users", "4", "--rounds",
                        "3", "--system-tokens", "128", "--history-tokens", "256", "--question-tokens", "16",
                        "--answer-tokens", "4", "--chunk-size", "64", "--rate", "20", "--cpu-capacity", "64MiB",
                        "--configs", ",".join(names))
    _check_record(rec, tiny_model_dir)
    _check_table(printed, f"multi-round-qa: {rec['model']['name']} (sim clock)",
                 ["config", "TTFT mean s", "p99", "gen tok/s", "preempt"])
    lines = printed.splitlines()
    for name in KV_CONFIGS:  # a ratio line per kvlayer configuration, the goal's verdict on cpu+nvme's only
        (line,) = [line for line in lines if line.startswith(f"{name} vs engine: mean TTFT")]
        assert ("(goal:" in line) is (name == "cpu+nvme"), line
    (goal,) = [line for line in lines if "(goal:" in line]
    assert goal.endswith(f": {_verdict(rec['goals']['cpu+nvme']['goal_met'])})"), goal
    assert rec["working_set_over_engine_kv"] > 2
    by = _check_serving(rec["results"], names, KV_CONFIGS)
    assert by["engine"]["hit_rate"]["engine"] > 0  # the shared system prompt stays hot
    for name in KV_CONFIGS:
        assert by[name]["warmup"]["requests"] == 4
        assert len(rec["requests"][name]) == 8
    assert rec["goals"]["cpu+nvme"]["mean_ttft_x_lower"] > 0


def test_long_doc_qa_serves_repeated_documents_from_the_lower_tiers(tiny_model_dir, tmp_path, capsys):
    names = ["recompute", "engine", *KV_CONFIGS]
    rec, printed = _run(tmp_path, capsys, "long-doc-qa", "--model", tiny_model_dir, "--docs", "4", "--doc-tokens",
                        "256", "--queries", "2", "--question-tokens", "8", "--answer-tokens", "2", "--chunk-size",
                        "64", "--configs", ",".join(names))
    _check_record(rec, tiny_model_dir)
    _check_table(printed, f"long-doc-qa: {rec['model']['name']}", ["config", "TTFT mean s", "p99", "recomputed"])
    goals = [line for line in printed.splitlines() if "(goal >= 90%:" in line]
    with_lower_tiers = [n for n in KV_CONFIGS if n != "cpu"]  # the goal is only theirs
    assert [g.split(":")[0] for g in goals] == with_lower_tiers
    for name, line in zip(with_lower_tiers, goals):
        r = next(r for r in rec["results"] if r["config"] == name)["reuse"]
        assert line == (f"{name}: {100 * r['from_kvlayer']:.1f}% of repeated-document tokens served from "
                        f"kvlayer (goal >= 90%: {_verdict(r['goal_met'])})")
    # the CPU tier holds two documents of four: alone, it may serve nothing (LRU over a cycle)
    by = _check_serving(rec["results"], names, [n for n in KV_CONFIGS if n != "cpu"])
    assert by["cpu+nvme"]["hit_rate"]["nvme"] > 0
    for name in ("cpu+nvme", "nvme", *(["redis"] if HAVE_REDIS else [])):
        reuse = by[name]["reuse"]
        assert reuse["repeated_queries"] == 4
        assert reuse["from_kvlayer"] >= 0.5, name
        assert "goal_met" in reuse
    assert by["recompute"]["reuse"]["from_kvlayer"] == 0


def test_an_unknown_config_is_a_usage_error(tiny_model_dir, tmp_path, capsys):
    code = main(["bench", "long-doc-qa", "--model", tiny_model_dir, "--configs", "cpu,floppy",
                 "--home", str(tmp_path)])
    assert code == 2 and "floppy" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ttft", "multi-round-qa", "long-doc-qa", "miss-overhead", "engine"])
def test_help_lists_the_output_and_comparison_options(command, capsys):
    with pytest.raises(SystemExit):
        main(["bench", command, "--help"])
    text = capsys.readouterr().out
    assert "--plot" in text and "--json" in text
    assert ("--configs" in text) is (command != "engine"), "engine compares with transformers, not tiers"


def test_miss_overhead_pairs_every_config_with_the_shared_baseline_and_never_hits(tiny_model_dir, tmp_path, capsys):
    rec, printed = _run(tmp_path, capsys, "miss-overhead", "--model", tiny_model_dir, "--configs", "cpu,nvme",
                        "--length", "64", "--rounds", "2", "--chunk-size", "32")
    _check_record(rec, tiny_model_dir)
    _check_table(printed, f"bench miss-overhead: {rec['model']['name']} (2 layers)",
                 ["config", "rounds", "overhead %", "chunk puts"])
    verdicts = "; ".join(f"{name} {r['overhead_pct']:+.2f}% {'met' if r['goal_met'] else 'NOT met'}"
                         for name, r in rec["configs"].items())
    assert f"goal: <= 2% (kvlayer issue 3): {verdicts}" in printed.splitlines()
    assert list(rec["configs"]) == ["cpu", "nvme"]
    for name, r in rec["configs"].items():
        assert r["median_off_s"] > 0 and r["median_on_s"] > 0, name
        assert [(p["round"], p["order"]) for p in r["pairs"]] == [(0, "off,on"), (1, "on,off")]
        assert r["overhead_pct"] == pytest.approx((r["median_on_s"] / r["median_off_s"] - 1) * 100)
        assert r["pair_min_pct"] <= r["pair_max_pct"]
        assert r["goal_met"] is (r["overhead_pct"] <= rec["goal_pct"])
        assert r["put_chunks"][name] == 2 * 64 // 32, name  # two requests, two chunks each
        assert set(r["hit_tokens"].values()) == {0}, name


def test_engine_compares_prefill_and_decode_with_transformers(tiny_model_dir, tmp_path, capsys):
    rec, printed = _run(tmp_path, capsys, "engine", "--model", tiny_model_dir, "--lengths", "32,64",
                        "--decode-seqs", "2", "--decode-prompt", "16", "--decode-tokens", "4", "--repeat", "3")
    _check_record(rec, tiny_model_dir)
    assert rec["settings"]["lengths"] == [32, 64] and rec["settings"]["no_hf"] is False
    assert [p["tokens"] for p in rec["prefill"]] == [32, 64]
    for p in rec["prefill"]:
        assert len(p["ours_runs_s"]) == len(p["hf_runs_s"]) == 3
        assert p["ours_s"] == sorted(p["ours_runs_s"])[1] and p["hf_s"] == sorted(p["hf_runs_s"])[1]
        assert p["ours_s"] > 0 and p["hf_s"] > 0 and p["ratio"] == pytest.approx(p["hf_s"] / p["ours_s"])
    d = rec["decode"]
    assert d["seqs"] == 2 and d["ours_tok_s"] > 0 and d["hf_tok_s"] > 0
    assert d["ratio"] == pytest.approx(d["ours_tok_s"] / d["hf_tok_s"])
    assert d["preemptions"] == 0, "the engine's KV cache is sized for every case"
    _check_table(printed, f"bench engine: {rec['model']['name']} (2 layers, float32)",
                 ["case", "ours tok/s", "transformers tok/s", "ratio"])
    for case in ("prefill 32", "prefill 64", "decode (2 seqs vs 1)"):
        assert case in printed


def test_engine_without_transformers_still_tables_and_plots(tiny_model_dir, tmp_path, capsys):
    rec, printed = _run(tmp_path, capsys, "engine", "--model", tiny_model_dir, "--lengths", "32", "--decode-seqs",
                        "2", "--decode-prompt", "16", "--decode-tokens", "2", "--no-hf")
    assert rec["prefill"][0]["hf_s"] is None and rec["prefill"][0]["ratio"] is None
    assert rec["decode"]["hf_tok_s"] is None and rec["decode"]["ratio"] is None
    assert f"bench engine: {rec['model']['name']}" in printed
