"""The ``kvlayer`` command's errors: one line on stderr, exit 2, before any work is done.

A bad flag of a ``kvlayer bench`` command is caught while parsing, so no model is made under
``--home`` (the 476 MB ``bench`` model was written before ``--lengths abc`` failed); a bad
config file or model folder is one line too, never a traceback.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlayer.cli import main

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("argv", "says"), [
    (["ttft", "--lengths", "abc"], "argument --lengths: not an integer: 'abc'"),
    (["ttft", "--lengths", "1,,2"], "argument --lengths: empty item in '1,,2'"),
    (["ttft", "--lengths", "128,"], "argument --lengths: empty item"),
    (["ttft", "--lengths", "0"], "argument --lengths: must be positive, got 0"),
    (["ttft", "--lengths", "-5"], "argument --lengths: must be positive, got -5"),
    (["ttft", "--suffix", "-1"], "argument --suffix: must be positive, got -1"),
    (["ttft", "--repeat", "0"], "argument --repeat: must be positive"),
    (["ttft", "--chunk-size", "0"], "argument --chunk-size: must be positive"),
    (["ttft", "--cpu-capacity", "12XB"], "argument --cpu-capacity: not a size: '12XB'"),
    (["ttft", "--configs", "cpu,floppy"], "argument --configs: unknown configuration 'floppy'"),
    (["ttft", "--device", "gpu"], "argument --device: unknown device 'gpu'"),
    (["ttft", "--plot", "/"], "argument --plot: '/' is a folder"),
    (["ttft", "--json", "/proc/kvlayer/out.json"], "argument --json: cannot write"),
    (["ttft", "--lengths", "256,128"], "--lengths must be ascending, got 256,128"),
    (["engine", "--lengths", "0"], "argument --lengths: must be positive"),
    (["engine", "--decode-seqs", "0"], "argument --decode-seqs: must be positive"),
    (["multi-round-qa", "--users", "0"], "argument --users: must be positive"),
    (["multi-round-qa", "--rate", "0"], "argument --rate: must be positive"),
    (["multi-round-qa", "--history-tokens", "-1"], "argument --history-tokens: must be >= 0"),
    (["multi-round-qa", "--cpu-capacity", "lots"], "argument --cpu-capacity: not a size"),
    (["multi-round-qa", "--rounds", "4", "--warmup-rounds", "4"], "--warmup-rounds must be below --rounds (4)"),
    (["long-doc-qa", "--docs", "0"], "argument --docs: must be positive"),
    (["miss-overhead", "--length", "0"], "argument --length: must be positive"),
    (["miss-overhead", "--configs", "recompute,cpu"], "--configs takes kvlayer configurations only"),
])
def test_a_bad_bench_flag_is_one_line_and_makes_no_model(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVLAYER_SMOKE", raising=False)
    home = tmp_path / "home"
    assert main(["bench", *argv, "--home", str(home)]) == 2
    err = one_line_error(capsys)
    assert says in err and err.startswith("kvlayer"), err
    assert not home.exists(), "the flags are checked before a model is made"


def test_a_device_this_torch_lacks_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    home = tmp_path / "home"
    assert main(["bench", "ttft", "--device", "cuda", "--home", str(home)]) == 2
    err = one_line_error(capsys)
    assert "argument --device: device 'cuda' is not available: this torch build has no CUDA" in err
    assert not home.exists()
    assert main(["demo", "--device", "cuda", "--home", str(home)]) == 2
    assert "device 'cuda' is not available" in one_line_error(capsys) and not home.exists()


def test_smoke_runs_check_the_flags_before_making_their_tiny_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVLAYER_SMOKE", "1")
    home = tmp_path / "home"
    assert main(["bench", "ttft", "--suffix", "-1", "--home", str(home)]) == 2
    assert "argument --suffix: must be positive, got -1" in one_line_error(capsys)
    assert not home.exists()


def test_config_and_model_folder_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu_capacity: [1\n")
    assert main(["config", "--file", str(bad)]) == 2
    assert one_line_error(capsys).startswith(f"kvlayer: error: {bad}: malformed YAML: ")
    bad.write_text("cpu_capacity: 12XB\n")
    assert main(["config", "--file", str(bad)]) == 2
    assert "invalid value for cpu_capacity: not a size: '12XB'" in one_line_error(capsys)
    assert main(["demo", "--kv-config", str(bad), "--home", str(tmp_path / "home")]) == 2
    assert "argument --kv-config: invalid value for cpu_capacity" in one_line_error(capsys)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert main(["model", "init", "--out", str(folder)]) == 2
    assert one_line_error(capsys) == f"kvlayer: error: model folder {str(folder)!r} is not empty\n"


def test_model_init_writes_sliding_windows_and_refuses_them_where_unknown(tmp_path, capsys):
    import json

    from kvlayer.engine.model_config import load_model_config

    out = tmp_path / "hybrid"
    assert main(["model", "init", "--arch", "qwen2", "--sliding-window", "32", "--layer-types",
                 "sliding_attention,full_attention", "--out", str(out)]) == 0
    assert "window 32" in capsys.readouterr().out
    assert load_model_config(out).layer_windows == (32, None)
    assert json.loads((out / "config.json").read_text())["use_sliding_window"] is True
    assert main(["model", "init", "--arch", "llama", "--sliding-window", "32", "--out", str(tmp_path / "l")]) == 2
    assert "not supported by architecture 'llama'" in one_line_error(capsys)
    assert main(["model", "init", "--sliding-window", "0", "--out", str(tmp_path / "z")]) == 2
    assert "argument --sliding-window" in one_line_error(capsys)


def test_a_corrupt_model_folder_is_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.delenv("KVLAYER_SMOKE", raising=False)
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["demo", "--model", str(folder), "--turns", "1", "--home", str(tmp_path / "home")]) == 2
    assert f"{str(weights)!r} is corrupt or truncated" in one_line_error(capsys)


def test_usage_errors_are_one_line_too(capsys):
    assert main(["bench", "ttft", "--no-such-flag"]) == 2
    assert one_line_error(capsys) == "kvlayer: error: unrecognized arguments: --no-such-flag\n"
    assert main([]) == 2
    assert "the following arguments are required: command" in one_line_error(capsys)


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"kvlayer {importlib.metadata.version('kvlayer')}\n"


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    return subprocess.run([sys.executable, "-m", "kvlayer.cli", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**clean, **env}, timeout=120)


def test_the_log_level_comes_from_the_environment():
    bad = run_cli("config", KVLAYER_LOG_LEVEL="loud")
    assert bad.returncode == 2
    assert bad.stderr == "kvlayer: error: KVLAYER_LOG_LEVEL must be one of debug, info, warning, error, got 'loud'\n"
    ok = run_cli("config", KVLAYER_LOG_LEVEL="DEBUG")
    assert ok.returncode == 0 and "chunk_size: 256" in ok.stdout


def test_the_entry_point_prints_no_traceback(tmp_path):
    out = run_cli("controller", "--listen", "127.0.0.1:99999")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "port must be 0..65535" in out.stderr
