"""Tests of kvlayer/tier_settings.py and kvlayer/values.py: declarations, sections, their two
spellings in a config, and that the core names no tier (docs/architecture.md section 13)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvlayer.config import ConfigError, KVLayerConfig
from kvlayer.tier_settings import FrozenMap, Section, Setting, TierSettings, flat_keys, installed, resolve_tiers
from kvlayer.values import parse_value
from tests.fakes import CHUNK_BYTES, context

ROOT = Path(__file__).resolve().parents[2]
TAPE = TierSettings((Setting("bucket", "str | None", None), Setting("parts", "int", 4),
                     Setting("size", "size", "1KiB")), enabled=lambda s: s["bucket"] is not None)


def test_a_section_is_typed_with_defaults_filled_and_says_whether_it_enables_its_tier() -> None:
    section = TAPE.resolve("tape", {"parts": "8"})
    assert section == {"bucket": None, "parts": 8, "size": 1024} and not section.enabled
    assert section.tier == "tape" and section.flat() == {"tape_bucket": None, "tape_parts": 8, "tape_size": 1024}
    assert TAPE.resolve("tape", {"bucket": "b"}).enabled
    assert hash(section) == hash(TAPE.resolve("tape", {"parts": 8}))
    with pytest.raises(AttributeError):
        section.tier = "other"  # type: ignore[misc]


def test_a_sections_unknown_key_or_bad_value_is_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as e:
        TAPE.resolve("tape", {"buckt": "b"})
    assert str(e.value) == "unknown setting 'buckt' of tier 'tape' (tiers.tape.buckt); its settings: " \
                           "['bucket', 'parts', 'size']"
    with pytest.raises(ConfigError, match="^invalid value for tape_parts: 'many' \\(expected int\\)$"):
        TAPE.resolve("tape", {"parts": "many"})
    with pytest.raises(ConfigError, match="no installed tier declares settings named 'disk'"):
        resolve_tiers({"disk": {}}, {"tape": TAPE})
    with pytest.raises(ConfigError, match="tiers.tape must be a mapping"):
        resolve_tiers({"tape": ["bucket"]}, {"tape": TAPE})


def test_declarations_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown kind 'list'"):
        Setting("hosts", "list", ())
    with pytest.raises(ValueError, match="lowercase identifier"):
        Setting("Bucket", "str", "")
    with pytest.raises(ConfigError, match="parts"):
        Setting("parts", "int", "four")
    with pytest.raises(ValueError, match="each setting once"):
        TierSettings((Setting("a", "int", 0), Setting("a", "int", 1)))
    with pytest.raises(ConfigError, match="'a_b' and 'a'|'a' and 'a_b'"):
        flat_keys({"a": TierSettings((Setting("b_c", "int", 0),)), "a_b": TierSettings((Setting("c", "int", 0),))})


def test_values_parse_as_their_kind() -> None:
    assert parse_value("x", "bool", "Yes") is True and parse_value("x", "float", "0.5") == 0.5
    assert parse_value("x", "str | None", "null") is None and parse_value("x", "size", "2KiB") == 2048
    assert parse_value("x", "str", 0.25) == "0.25" and parse_value("x", "str", 123) == "123"  # YAML's numbers
    for kind, bad in (("bool", "maybe"), ("int", 1.5), ("float", True), ("str", [1.0]), ("str", True), ("int", None)):
        with pytest.raises(ConfigError, match="x"):
            parse_value("x", kind, bad)


def test_the_builtin_tiers_declare_their_settings() -> None:
    declared = installed()
    assert {"gpu", "cpu", "nvme", "redis"} <= set(declared)
    assert {"cpu_capacity", "gpu_capacity", "nvme_path", "nvme_capacity", "nvme_fsync", "redis_url", "redis_cluster",
            "redis_ttl_s", "redis_key_prefix"} <= set(flat_keys(declared))
    assert set(KVLayerConfig().tiers) == set(declared)


def test_flat_keys_and_sections_are_two_spellings_of_one_setting() -> None:
    flat = KVLayerConfig.from_dict({"nvme_path": "/x", "nvme_capacity": "1GiB", "cpu_capacity": 0})
    nested = KVLayerConfig.from_dict({"tiers": {"nvme": {"path": "/x", "capacity": "1GiB"}, "cpu": {"capacity": 0}}})
    assert flat == nested and hash(flat) == hash(nested)
    assert nested.nvme_path == "/x" and nested.tiers["nvme"]["capacity"] == 1024**3 and nested.cpu_capacity == 0
    assert KVLayerConfig(tiers={"redis": {"url": "redis://h"}}).redis_url == "redis://h"
    assert KVLayerConfig.from_dict(nested.to_dict()) == nested and "tiers" not in nested.to_dict()
    assert not hasattr(nested, "nvme_colour") and not hasattr(nested, "tape_bucket")


def test_in_one_source_the_section_wins_and_a_later_source_wins_whatever_its_spelling(tmp_path) -> None:
    both = {"nvme_path": "/flat", "tiers": {"nvme": {"path": "/section"}}}
    assert KVLayerConfig.from_dict(both).nvme_path == "/section"
    path = tmp_path / "kvlayer.yaml"
    path.write_text("tiers:\n  nvme:\n    path: /yaml\n    fsync: true\n")
    cfg = KVLayerConfig.load(path, env={"KVLAYER_NVME_PATH": "/env"})
    assert (cfg.nvme_path, cfg.nvme_fsync) == ("/env", True)
    cfg = KVLayerConfig.load({"nvme_path": "/dict"}, env={"KVLAYER_TIERS": "{nvme: {path: /env-section}}"})
    assert cfg.nvme_path == "/env-section"
    assert cfg.replace(tiers={"nvme": {"fsync": True}}).tiers["nvme"] == {**cfg.tiers["nvme"], "fsync": True}
    assert cfg.replace(nvme_path="/replaced").nvme_path == "/replaced"


def test_a_loaded_config_is_taken_as_it_is_so_a_change_made_to_it_survives_the_variables() -> None:
    env = {"KVLAYER_NVME_PATH": "/env", "KVLAYER_CPU_CAPACITY": "1GiB"}
    cfg = KVLayerConfig.load({}, env=env).replace(nvme_path=None)  # e.g. serve leaving an unusable place out
    again = KVLayerConfig.load(cfg, env=env)
    assert again is cfg and again.nvme_path is None and again.cpu_capacity == 2**30


def test_a_bad_tiers_value_is_one_line() -> None:
    for bad, says in (({"tiers": [1]}, "tiers must be a mapping"), ({"tiers": {"nvme": 3}}, "tiers.nvme must be"),
                      ({"tiers": {"nvme": {"colour": 1}}}, "unknown setting 'colour' of tier 'nvme'"),
                      ({"tiers": {"redis": {"url": "http://x"}}}, "redis_url must start with")):
        with pytest.raises(ConfigError, match=says) as e:
            KVLayerConfig.from_dict(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="tiers: malformed YAML"):
        KVLayerConfig.load({}, env={"KVLAYER_TIERS": "{nvme: [}"})
    assert KVLayerConfig.from_dict({"tiers": None}) == KVLayerConfig.from_dict({"tiers": {"nvme": None}})


def test_a_backend_reads_its_own_section_from_the_context() -> None:
    ctx = context(tiers={"cpu": {"capacity": CHUNK_BYTES}, "nvme": {"path": "/kv"}})
    assert ctx.tier_settings("cpu") == {"capacity": CHUNK_BYTES}
    assert ctx.tier_settings("nvme")["path"] == "/kv" and isinstance(ctx.tier_settings("nvme"), Section)
    assert ctx.tier_settings("no-such-tier") == {}
    assert isinstance(ctx.config.tiers, FrozenMap)


def names_in_code(path: Path) -> set[str]:
    """Every identifier and string constant of ``path``, its docstrings (strings standing alone) left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.add(node.value)
    return out


@pytest.mark.parametrize("module", ["config.py", "registry.py", "tier_settings.py", "values.py"])
def test_the_core_names_no_tier(module: str) -> None:
    named = {word for text in names_in_code(ROOT / "kvlayer" / module)
             for word in text.lower().replace("_", " ").replace(".", " ").split()}
    assert not named & {"gpu", "cpu", "nvme", "redis"}, f"kvlayer/{module} names a tier"


def test_a_tier_that_stands_in_for_another_turns_it_off_unless_the_config_sets_it() -> None:
    """The ``cache`` tier (a node cache server) declares ``replaces=("cpu", "capacity", 0)``."""
    assert KVLayerConfig().cpu_capacity == 4 << 30, "no server: the default CPU tier"
    served = KVLayerConfig(cache_server="/tmp/kv.sock")
    assert served.cpu_capacity == 0 and not served.tiers["cpu"].enabled and served.tiers["cache"].enabled
    assert served.replace(chunk_size=512).cpu_capacity == 0, "a round trip keeps it"
    both = KVLayerConfig(cache_server="/tmp/kv.sock", cpu_capacity="1GiB")
    assert both.cpu_capacity == 1 << 30, "a CPU tier the config asks for stays"
    sections = {"cache": {"server": "/tmp/kv.sock"}, "cpu": {"capacity": "2GiB"}}
    assert KVLayerConfig(tiers=sections).cpu_capacity == 2 << 30
    with pytest.raises(ValueError, match="replaces must be"):
        TierSettings((Setting("x", "int", 0),), replaces=("cpu",))
