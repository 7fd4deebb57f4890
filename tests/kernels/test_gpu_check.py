"""Tests of benchmarks/gpu_check.py's parts that need no GPU: arguments, arithmetic, the report,
the 1B model's shape, the kernel checks on the CPU (Triton interpreter) and the no-CUDA exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvlayer.benchmarks import gpu_check

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def test_arguments() -> None:
    args = gpu_check.parse_args([])
    assert args.lengths == [8192, 32768] and args.goal == 0.8 and args.out is None and not args.no_ttft
    args = gpu_check.parse_args(["--lengths", "1024,2048", "--bw-tokens", "256", "--out", "x.json", "--no-ttft"])
    assert args.lengths == [1024, 2048] and args.bw_tokens == [256] and args.out == "x.json" and args.no_ttft
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--lengths", "40960"])


def test_bandwidth_arithmetic() -> None:
    row = gpu_check.bandwidth_row("gather", 2**30, 0.5, 0.4, 0.8, "note")
    assert row.measured == 2.0 and row.reference == 2.5 and row.unit == "GiB/s"
    assert row.ratio == pytest.approx(0.8) and row.passed
    assert not gpu_check.bandwidth_row("gather", 2**30, 0.5, 0.39, 0.8, "").passed
    assert gpu_check.gib_per_s(3 * 2**30, 1.5) == 2.0


def test_report_and_table(tmp_path) -> None:
    rows = [gpu_check.check_row("gather", 0.0, 0.0, "worst: x"),
            gpu_check.check_row("decode", 0.1, 0.01),
            gpu_check.Row("ttft", "8192 tok cold", 1.5, None, "s")]
    cells = gpu_check.table_rows(rows)
    assert len(cells[0]) == len(gpu_check.COLUMNS)
    assert [c[6] for c in cells] == ["ok", "FAIL", None]
    result = gpu_check.report(rows, gpu_check.parse_args([]), {"gpu": None})
    assert not result["passed"] and result["rows"][1]["what"] == "decode"
    assert gpu_check.report(rows[::2], gpu_check.parse_args([]), {})["passed"]
    out = tmp_path / "r.json"
    out.write_text(json.dumps(result))
    assert json.loads(out.read_text())["rows"][2]["measured"] == 1.5


def test_the_1b_model_has_about_a_billion_parameters() -> None:
    config = gpu_check.model_1b_config()
    assert config["torch_dtype"] == "bfloat16" and config["num_hidden_layers"] == 16
    assert 0.9e9 < gpu_check.parameter_count(config) < 1.3e9


def test_kernel_checks_pass_on_the_cpu() -> None:
    pytest.importorskip("triton")
    sizes = gpu_check.CheckSizes(heads_dims=((2, 16), (1, 64)), layers=2, num_blocks=8, tokens=40,
                                 decode_gqa=((4, 4, 32), (8, 2, 16)), decode_lens=(1, 17, 40))
    rows = gpu_check.kernel_checks(torch.device("cpu"), sizes)
    assert {r.what for r in rows} >= {"gather all layers", "scatter one layer", "decode attention bfloat16"}
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]


@no_cuda
def test_main_without_cuda_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--no-ttft"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@no_cuda
def test_module_entry_point_without_cuda() -> None:
    out = subprocess.run([sys.executable, "-m", "kvlayer.benchmarks.gpu_check"], capture_output=True, text=True)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr
