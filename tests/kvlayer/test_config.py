"""Tests of kvlayer/config.py and kvlayer/sizes.py: sizes, sources and their order, errors, frozen."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from kvlayer.config import ConfigError, KVLayerConfig, env_overrides
from kvlayer.sizes import format_size, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("4GiB", 4 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("100", 100),
    (" 2 kib ", 2048), ("0", 0), (123, 123), ("1k", 1000),
])
def test_parse_size(text, size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["4 GiBs", "-1", "1.2.3", "", True, -5, None, "GiB"])
def test_parse_size_rejects(bad) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(4 * 1024**3) == "4.0GiB" and format_size(1536) == "1.5KiB" and format_size(10) == "10B"


def test_sizes_and_strings_are_converted_on_construction() -> None:
    cfg = KVLayerConfig(cpu_capacity="2GiB", gpu_capacity="64MiB", chunk_size="128", layerwise="false")
    assert cfg.cpu_capacity == 2 * 1024**3 and cfg.gpu_capacity == 64 * 1024**2
    assert cfg.chunk_size == 128 and cfg.layerwise == "off"
    assert KVLayerConfig().layerwise == "on" and KVLayerConfig(layerwise=False).layerwise == "off"
    assert KVLayerConfig(layerwise="AUTO").layerwise == "auto"
    assert KVLayerConfig(nvme_path="none").nvme_path is None


def test_yaml_file_then_env_overrides(tmp_path) -> None:
    path = tmp_path / "kvlayer.yaml"
    path.write_text("chunk_size: 64\ncpu_capacity: 1GiB\nnvme_path: /tmp/kv\nredis_url: redis://h:6379/0\n")
    cfg = KVLayerConfig.load(path, env={"KVLAYER_CPU_CAPACITY": "256MiB", "KVLAYER_NVME_FSYNC": "yes",
                                        "KVLAYER_ADMIN_TOKEN": "not config", "PATH": "/bin"})
    assert cfg.chunk_size == 64 and cfg.nvme_path == "/tmp/kv" and cfg.redis_url == "redis://h:6379/0"
    assert cfg.cpu_capacity == 256 * 1024**2 and cfg.nvme_fsync is True
    assert KVLayerConfig.from_yaml(path).cpu_capacity == 1024**3
    assert KVLayerConfig.load({"chunk_size": 32}, env={}).chunk_size == 32
    assert KVLayerConfig.load(None, env={}) == KVLayerConfig()


def test_unknown_keys_name_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cpu_capacty"):
        KVLayerConfig.from_dict({"cpu_capacty": 1})
    with pytest.raises(ConfigError, match="KVLAYER_BOGUS"):
        env_overrides({"KVLAYER_BOGUS": "1"})
    path = tmp_path / "bad.yaml"
    path.write_text("chunk_size: 64\nbogus_key: 1\n")
    with pytest.raises(ConfigError, match="bogus_key"):
        KVLayerConfig.from_yaml(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        KVLayerConfig.from_yaml(path)


@pytest.mark.parametrize(("key", "value"), [
    ("chunk_size", "abc"), ("chunk_size", 0), ("chunk_size", 1.5), ("cpu_capacity", "lots"),
    ("layerwise", "maybe"), ("compression", "zstd"), ("tier_timeout_ms", 0), ("unhealthy_after", -1),
    ("redis_url", "http://x"), ("redis_ttl_s", -3), ("chunk_size", True), ("chunk_size", None),
    ("instance_role", "router"), ("instance_role", ""),
])
def test_bad_values_name_the_key(key, value) -> None:
    with pytest.raises(ConfigError, match=key):
        KVLayerConfig.from_dict({key: value})
    with pytest.raises(ConfigError, match=key):
        KVLayerConfig.load({}, env={f"KVLAYER_{key.upper()}": str(value)})


def test_instance_role_defaults_to_both_and_is_one_of_three() -> None:
    assert KVLayerConfig().instance_role == "both"
    assert KVLayerConfig.load({}, env={"KVLAYER_INSTANCE_ROLE": "prefill"}).instance_role == "prefill"
    with pytest.raises(ConfigError) as e:
        KVLayerConfig(instance_role="Prefill")
    assert str(e.value) == "instance_role must be one of ('both', 'prefill', 'decode'), got 'Prefill'"


def test_frozen_and_replace_returns_a_new_config() -> None:
    cfg = KVLayerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 1  # type: ignore[misc]
    other = cfg.replace(chunk_size=16)
    assert other.chunk_size == 16 and cfg.chunk_size == 256
    with pytest.raises(ConfigError, match="nope"):
        cfg.replace(nope=1)
    assert KVLayerConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(KVLayerConfig.load(None, env={})), "hashable, by value"
    assert copy.deepcopy(cfg) == cfg and copy.copy(cfg.replace(nvme_path="/x")).nvme_path == "/x"
    with pytest.raises(TypeError):
        cfg.tiers["cpu"]["capacity"] = 1  # type: ignore[index]


def test_backoff_settings_are_checked() -> None:
    assert KVLayerConfig(unhealthy_backoff_ms=50, unhealthy_backoff_max_ms=50).unhealthy_backoff_max_ms == 50
    for bad in ({"unhealthy_backoff_ms": 0}, {"unhealthy_backoff_ms": 40_000}, {"unhealthy_backoff_max_ms": 10}):
        with pytest.raises(ConfigError, match="unhealthy_backoff"):
            KVLayerConfig(**bad)


@pytest.mark.parametrize(("value", "says"), [
    (-5, "a size must be >= 0, got -5"), ("-5GiB", "a size must be >= 0, got '-5GiB'"),
    ("12XB", "not a size: '12XB' (unknown unit 'XB'"), ("lots", "not a size: 'lots'"),
])
def test_a_bad_size_keeps_the_size_parsers_message_and_names_the_key(value, says) -> None:
    with pytest.raises(ConfigError) as e:
        KVLayerConfig.from_dict({"cpu_capacity": value})
    assert str(e.value).startswith("invalid value for cpu_capacity: ") and says in str(e.value)
    with pytest.raises(ConfigError) as e:  # from the environment, the value is a string
        KVLayerConfig.load({}, env={"KVLAYER_CPU_CAPACITY": str(value)})
    assert str(e.value).startswith("invalid value for cpu_capacity: ") and "size" in str(e.value)


@pytest.mark.parametrize(("text", "where"), [
    ("cpu_capacity: [1\n", "line 2, column 1"), ("a: b: c\n", "line 1, column 5"),
])
def test_malformed_yaml_is_one_line_naming_the_file_and_the_place(tmp_path, text, where) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        KVLayerConfig.from_yaml(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: malformed YAML: ") and where in message
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        KVLayerConfig.from_yaml(path)
