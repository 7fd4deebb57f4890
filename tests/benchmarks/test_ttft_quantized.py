"""Quantized-storage configurations (``nvme:int8``, ``redis:fp8``): their names, what the factory
builds for them, and ``kvlayer bench ttft`` measuring one next to exact storage on the tiny model
(bytes per token held, hit TTFT against exact, first token against recompute; no timing thresholds).

The ``redis:int8`` row joins the run when a ``redis-server`` binary is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvlayer.benchmarks.configs import ConfigFactory, ConfigName, TierSizes, parse_configs, parse_name
from kvlayer.benchmarks.ttft_storage import FIRST_TOKEN_NOTE, Stored, compare, stored_bytes
from kvlayer.cli import main

HAVE_REDIS = shutil.which("redis-server") is not None

# ----- names ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "split"), [
    ("nvme", ("nvme", "none")), ("nvme:int8", ("nvme", "int8")), ("cpu+nvme:fp8", ("cpu+nvme", "fp8")),
    ("redis:int8", ("redis", "int8")), ("recompute", ("recompute", "none")), ("cpu", ("cpu", "none")),
])
def test_a_quantization_suffix_splits_off(name: str, split: tuple[str, str]) -> None:
    assert parse_name(name) == ConfigName(*split)


@pytest.mark.parametrize(("name", "error"), [
    ("cpu:int8", "'cpu:int8': storage_quantization applies only to the NVMe and Redis tiers and the CPU tier "
                 "keeps exact tensors; use a configuration with one (cpu+nvme:int8, nvme:int8, redis:int8)"),
    ("gpu:fp8", "the GPU tier keeps exact tensors"),
    ("recompute:int8", "'recompute:int8': recompute runs without kvlayer, so it has no storage to quantize"),
    ("engine:fp8", "engine runs without kvlayer"),
    ("nvme:int4", "unknown storage quantization 'int4' in 'nvme:int4'; choose from int8, fp8"),
    ("nvme:none", "unknown storage quantization 'none'"),
    ("nvme:", "unknown storage quantization ''"),
    ("disk:int8", "unknown configuration 'disk:int8'; choose from recompute, engine, cpu"),
])
def test_a_bad_quantized_name_is_refused_in_one_line(name: str, error: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_configs(f"recompute,{name}")
    assert error in str(e.value) and "\n" not in str(e.value)


def test_parse_configs_keeps_quantized_names_apart_from_exact_ones() -> None:
    assert parse_configs("nvme,nvme:int8, nvme:fp8,nvme:int8") == ["nvme", "nvme:int8", "nvme:fp8"]


@pytest.mark.parametrize("command", ["ttft", "multi-round-qa", "long-doc-qa", "miss-overhead"])
def test_every_bench_with_configs_takes_quantized_ones_and_refuses_cpu_int8(command: str, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvlayer.cli import build_parser

    args = build_parser().parse_args(["bench", command, "--configs", "cpu+nvme:int8,nvme:fp8"])
    assert parse_configs(args.configs) == ["cpu+nvme:int8", "nvme:fp8"]
    assert main(["bench", command, "--configs", "nvme,cpu:int8", "--home", str(tmp_path)]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.endswith("'cpu:int8': storage_quantization applies only to the NVMe and Redis tiers and the CPU tier "
                         "keeps exact tensors; use a configuration with one (cpu+nvme:int8, nvme:int8, redis:int8)")


# ----- the factory --------------------------------------------------------------------------


def test_the_factory_sets_storage_quantization_for_a_quantized_name_only(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with ConfigFactory(TierSizes(chunk_size=64), str(tmp_path), None, False, False) as f:
        exact, q = f.build("nvme"), f.build("nvme:int8", label="x")
        assert "storage_quantization" not in exact.kv_config and exact.quantization == "none"
        assert q.kv_config["storage_quantization"] == "int8" and q.quantization == "int8" and q.label == "x"
        assert (q.name, q.base, q.lowest_tier, exact.base) == ("nvme:int8", "nvme", "nvme", "nvme")
        assert q.nvme_path != exact.nvme_path and ":" not in Path(q.nvme_path).name
        both = f.build("cpu+nvme:fp8")
        assert both.has_cpu_tier and both.lowest_tier == "nvme" and both.kv_config["storage_quantization"] == "fp8"
        assert f.build("cpu").lowest_tier == "cpu" and f.build("recompute").lowest_tier is None
        assert f.available(["nvme", "redis", "redis:int8"]) == ["nvme"]
        assert "the 'redis' and 'redis:int8' configurations are left out" in capsys.readouterr().out
        with pytest.raises(ValueError, match="'redis:int8' configuration needs --redis-url"):
            f.build("redis:int8")


# ----- the comparisons, without an engine ----------------------------------------------------


def test_stored_bytes_counts_the_nvme_files_and_a_hybrids_objects_per_chunk(tmp_path: Path) -> None:
    with ConfigFactory(TierSizes(chunk_size=64), str(tmp_path), None, False, False) as f:
        nvme, cpu = f.build("nvme:int8"), f.build("cpu")
        folder = Path(nvme.nvme_path) / "ab" / "cd"
        folder.mkdir(parents=True)
        for i in range(4):
            (folder / f"abcd{i}-{64 * i}.kvc").write_bytes(b"x" * 100)
        (folder / "abcd9-0.tmp-1").write_bytes(b"x" * 999)  # a write in flight is not held
        assert stored_bytes(None, nvme) == Stored("nvme", 400, 4, 64)
        two_groups = stored_bytes(None, nvme, objects_per_chunk=2)
        assert two_groups == Stored("nvme", 400, 2, 64) and two_groups.bytes_per_token == 400 / 128
        assert stored_bytes(None, cpu) is None, "a memory tier keeps exact tensors: nothing to measure"
        assert stored_bytes(None, f.build("nvme")) is None, "an empty folder holds no chunk"


def _variant(config: str, quantization: str, layerwise: bool, hit_s: float, token: int, bpt: float | None) -> dict:
    return {"config": config, "base": config.split(":")[0], "quantization": quantization, "layerwise": layerwise,
            "stored_bytes_per_token": bpt,
            "by_length": [{"prefix": 64, "hit_s": hit_s, "load_s": hit_s / 2, "hit_token": token}]}


def test_compare_pairs_a_quantized_variant_with_the_exact_one_of_its_loading_mode() -> None:
    variants = {"nvme lw=on": _variant("nvme", "none", True, 2.0, 7, 400.0),
                "nvme lw=off": _variant("nvme", "none", False, 4.0, 7, 400.0),
                "nvme:int8 lw=off": _variant("nvme:int8", "int8", False, 3.0, 8, 100.0),
                "redis:fp8": _variant("redis:fp8", "fp8", False, 1.0, 7, 100.0)}
    compare(variants, {64: {"cold_token": 7}})
    q = variants["nvme:int8 lw=off"]
    assert q["exact"] == "nvme lw=off" and q["stored_vs_exact"] == 0.25
    assert q["by_length"][0]["hit_vs_exact"] == 0.75 and q["by_length"][0]["load_vs_exact"] == 0.75
    assert q["by_length"][0]["first_token_matches"] is False
    assert q["first_token"] == {"matches": 0, "prompts": 1, "share": 0.0, "note": FIRST_TOKEN_NOTE}
    r = variants["redis:fp8"]  # no exact redis in the run
    assert r["exact"] is None and r["stored_vs_exact"] is None and r["by_length"][0]["hit_vs_exact"] is None
    assert r["first_token"]["share"] == 1.0
    assert "exact" not in variants["nvme lw=on"] and variants["nvme lw=on"]["first_token"]["matches"] == 1


# ----- a real run ---------------------------------------------------------------------------


def test_ttft_measures_quantized_storage_next_to_exact(tiny_model_dir: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    kv = ["nvme", "nvme:int8", *(["redis:int8"] if HAVE_REDIS else [])]
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    assert main(["bench", "ttft", "--model", tiny_model_dir, "--home", str(tmp_path / "home"), "--configs",
                 ",".join(["recompute", *kv]), "--lengths", "256", "--suffix", "8", "--chunk-size", "64",
                 "--layerwise", "off", "--partial", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(rec["variants"]) == kv
    exact, q = rec["variants"]["nvme"], rec["variants"]["nvme:int8"]
    assert (q["config"], q["base"], q["quantization"], q["exact"]) == ("nvme:int8", "nvme", "int8", "nvme")
    assert q["kv_config"]["storage_quantization"] == "int8" and exact["quantization"] == "none"

    # bytes per token, measured from the NVMe files: one byte per float32 value, plus scales and headers
    assert exact["stored"]["tier"] == "nvme" and exact["stored"]["chunks"] >= 256 // 64
    assert exact["stored_bytes_per_token"] >= rec["model"]["kv_bytes_per_token"]
    share = q["stored_bytes_per_token"] / exact["stored_bytes_per_token"]
    assert 0.2 <= share <= 0.35 and q["stored_vs_exact"] == pytest.approx(share)
    assert q["stored"]["bytes"] == pytest.approx(q["stored_bytes_per_token"] * q["stored"]["chunks"] * 64)

    base = rec["baselines"]["256"]
    (row,), (erow,) = q["by_length"], exact["by_length"]
    assert row["hit_tiers"] == {"nvme": 256} and row["hit_s"] > 0 and row["load_s"] > 0
    assert row["hit_vs_exact"] == pytest.approx(row["hit_s"] / erow["hit_s"])
    assert row["load_vs_exact"] == pytest.approx(row["load_s"] / erow["load_s"])
    # its floor moves the bytes the tier holds, not the float32 KV
    gib_s = rec["ceilings_gib_s"].get("nvme_cold", rec["ceilings_gib_s"]["memcpy"]) * 2**30
    assert row["floor_s"] == pytest.approx(256 * q["stored_bytes_per_token"] / gib_s + base["suffix_s"])

    # the first (and only) generated token, against recompute's, for the full and the partial prompt
    assert erow["hit_token"] == base["cold_token"] and erow["partial_hit_token"] == base["partial_cold_token"]
    assert exact["first_token"]["matches"] == exact["first_token"]["prompts"] == 2
    assert row["first_token_matches"] is (row["hit_token"] == base["cold_token"])
    assert q["first_token"]["prompts"] == 2 and 0 <= q["first_token"]["share"] <= 1
    assert "first generated token only" in q["first_token"]["note"]

    if HAVE_REDIS:  # the same encoding in Redis, counted from what kvlayer wrote; no exact redis ran
        r = rec["variants"]["redis:int8"]
        assert r["stored"]["tier"] == "redis" and r["by_length"][0]["hit_tiers"] == {"redis": 256}
        assert r["stored_bytes_per_token"] == pytest.approx(q["stored_bytes_per_token"])
        assert r["exact"] is None and r["stored_vs_exact"] is None and r["by_length"][0]["hit_vs_exact"] is None

    assert "quantized storage: bytes per token the tier holds" in printed
    header = next(line for line in printed.splitlines() if "B/tok vs exact" in line)
    assert all(c in header for c in ("config", "quant", "hit vs exact", "1st token = recompute")), header
    tallies = ", ".join(f"{label} {v['first_token']['matches']}/2" for label, v in rec["variants"].items())
    assert f"first token = recompute: {FIRST_TOKEN_NOTE}, over recompute's: {tallies}" in printed
