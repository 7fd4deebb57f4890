"""Memory sizes checked against the machine before anything is allocated (``kvlayer.capacity``):
``kvlayer config --check``, ``KVCacheEngine`` and ``kvlayer serve`` refuse what cannot fit, in one line."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from kvlayer import ConfigError, KVCacheEngine, KVLayout, capacity
from kvlayer.cli import main
from kvlayer.config import KVLayerConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)
GIB, MIB = 1024**3, 1024**2
TOO_MUCH = "200000GiB"
"""More host memory than any machine running these tests has."""


@pytest.fixture
def one_gib_machine(tmp_path, monkeypatch):
    """A /proc/meminfo saying 1 GiB is available, and no cgroup limit."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4194304 kB\nMemFree:         524288 kB\nMemAvailable:    1048576 kB\n")
    monkeypatch.setattr(capacity, "MEMINFO", meminfo)
    monkeypatch.setattr(capacity, "CGROUP", tmp_path / "no-cgroup")
    return meminfo


def test_asks_are_the_enabled_tiers_memory_settings_and_the_staging():
    config = KVLayerConfig.from_dict({"cpu_capacity": "3GiB", "gpu_capacity": "1GiB", "staging_capacity": "64MiB",
                                      "nvme_capacity": "900GiB"})
    assert capacity.asks(config) == [capacity.Ask("cpu_capacity", 3 * GIB, "host"),
                                     capacity.Ask("gpu_capacity", GIB, "device"),
                                     capacity.Ask("staging_capacity", 64 * MIB, "host")]
    off = config.replace(cpu_capacity=0, gpu_capacity=0)
    assert capacity.asks(off) == [capacity.Ask("staging_capacity", 64 * MIB, "host")]
    assert capacity.asks(config, tiers=False) == [capacity.Ask("staging_capacity", 64 * MIB, "host")]


def test_a_refusal_names_the_settings_the_sizes_and_the_machine(one_gib_machine):
    config = KVLayerConfig.from_dict({"cpu_capacity": "2GiB", "staging_capacity": "256MiB"})
    assert capacity.problems(config) == [
        "cpu_capacity 2.0GiB + staging_capacity 256.0MiB = 2.2GiB do not fit in this machine's available "
        f"memory, 1.0GiB (MemAvailable in {one_gib_machine}); lower cpu_capacity"]
    with pytest.raises(ConfigError, match=r"^cpu_capacity 2\.0GiB \+ .*; lower cpu_capacity$"):
        capacity.check_memory(config)
    fits = config.replace(cpu_capacity="512MiB")
    assert capacity.problems(fits) == []
    capacity.check_memory(fits)
    assert capacity.describe(fits) == ("cpu_capacity 512.0MiB + staging_capacity 256.0MiB fit in 1.0GiB "
                                       f"available (MemAvailable in {one_gib_machine})")


def test_on_the_cpu_the_device_arena_is_host_memory_too(one_gib_machine):
    config = KVLayerConfig.from_dict({"cpu_capacity": 0, "gpu_capacity": "3GiB", "staging_capacity": "1MiB"})
    line, = capacity.problems(config, "cpu")
    assert line.startswith("gpu_capacity 3.0GiB + staging_capacity 1.0MiB = 3.0GiB do not fit in this machine's")
    assert line.endswith("; lower gpu_capacity")


def test_a_cgroup_limit_lower_than_the_machine_is_what_counts(one_gib_machine, tmp_path, monkeypatch):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{512 * MIB}\n")
    (cgroup / "memory.current").write_text(f"{128 * MIB}\n")
    monkeypatch.setattr(capacity, "CGROUP", cgroup)
    assert capacity.host_available() == capacity.Available(384 * MIB, "cgroup memory.max")
    config = KVLayerConfig.from_dict({"cpu_capacity": "400MiB", "staging_capacity": 0})
    assert capacity.problems(config) == ["cpu_capacity 400.0MiB does not fit in this machine's available memory, "
                                         "384.0MiB (cgroup memory.max); lower cpu_capacity"]
    (cgroup / "memory.current").write_text(f"{480 * MIB}\n")  # mostly page cache, which the kernel reclaims
    (cgroup / "memory.stat").write_text(f"anon {96 * MIB}\nfile {384 * MIB}\ninactive_file {352 * MIB}\n")
    assert capacity.host_available() == capacity.Available(384 * MIB, "cgroup memory.max")
    (cgroup / "memory.max").write_text("max\n")  # no limit: the machine's figure again
    assert capacity.host_available().source == f"MemAvailable in {one_gib_machine}"


def test_config_check_refuses_an_impossible_capacity_in_one_line(tmp_path, capsys, caplog):
    path = tmp_path / "kvlayer.yaml"
    path.write_text(f"cpu_capacity: {TOO_MUCH}\n")
    assert main(["config", "--check", "--file", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1, out.err
    assert out.err.startswith("kvlayer: error: cpu_capacity 200000.0GiB + staging_capacity 512.0MiB = ")
    assert "do not fit in this machine's available memory" in out.err
    assert out.err.endswith("; lower cpu_capacity\n")

    path.write_text("cpu_capacity: 1MiB\nstaging_capacity: 1MiB\n")
    with caplog.at_level(logging.INFO, logger="kvlayer.cli"):  # what -v shows
        assert main(["config", "--check", "--file", str(path)]) == 0
    out = capsys.readouterr()
    assert (out.out, out.err) == ("kvlayer config: no nvme_path or redis_url to try\n", "")
    assert [r.getMessage() for r in caplog.records][-1].startswith(
        "kvlayer config: cpu_capacity 1.0MiB + staging_capacity 1.0MiB fit in ")


def test_the_cache_engine_refuses_before_allocating():
    with pytest.raises(ConfigError, match=r"^cpu_capacity .* do not fit in this machine's available memory, .*"
                                          r"; lower cpu_capacity$"):
        KVCacheEngine({"cpu_capacity": TOO_MUCH, "staging_capacity": "1MiB"}, LAYOUT)
    with pytest.raises(ConfigError, match="; lower gpu_capacity$"):
        KVCacheEngine({"cpu_capacity": 0, "gpu_capacity": TOO_MUCH, "staging_capacity": "1MiB"}, LAYOUT, "cpu")
    # Tiers given by the caller allocate nothing from the config: only the staging is checked.
    with KVCacheEngine({"cpu_capacity": TOO_MUCH, "staging_capacity": "1MiB"}, LAYOUT, backends=[]) as kv:
        assert kv.tier_names == []
    with pytest.raises(ConfigError, match="^staging_capacity .* does not fit .*; lower staging_capacity$"):
        KVCacheEngine({"staging_capacity": TOO_MUCH}, LAYOUT, backends=[])


def test_serve_refuses_an_impossible_capacity_before_the_model_loads(tmp_path, tiny_model_dir):
    path = tmp_path / "kvlayer.yaml"
    path.write_text(f"cpu_capacity: {TOO_MUCH}\n")
    done = subprocess.run([sys.executable, "-m", "kvlayer.cli", "serve", "--model", tiny_model_dir, "--port", "0",
                           "--kv-config", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvlayer: error: cpu_capacity ") and lines[0].endswith("; lower cpu_capacity")
