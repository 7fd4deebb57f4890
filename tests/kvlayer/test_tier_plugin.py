"""A third-party tier (the distribution in tests/tier_plugin) installed through the entry points
and configured from YAML: its own setting reaches it, chunks go through it, its section is checked.

It is installed the way pip lays a distribution out, without pip or a network: a ``.dist-info``
whose ``entry_points.txt`` is made from the distribution's pyproject.toml, beside copies of its
modules, in a temporary folder on the ``PYTHONPATH`` of a fresh interpreter (this process keeps
the entry points it was started with).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

PLUGIN = Path(__file__).resolve().parents[1] / "tier_plugin"
LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK, TOKENS = 2, 2, 4, 4, 8, 16

ENGINE = f"""
import json, sys, torch
from kvlayer import KVCacheEngine, KVLayout
layout = KVLayout(num_layers={LAYERS}, num_kv_heads={HEADS}, head_dim={HEAD_DIM}, dtype=torch.float32,
                  block_size={BLOCK})
gen = torch.Generator().manual_seed(0)
caches = [torch.randn(2, 8, {BLOCK}, {HEADS}, {HEAD_DIM}, generator=gen) for _ in range({LAYERS})]
tokens, slots = list(range(1, {TOKENS} + 1)), torch.arange({TOKENS})
with KVCacheEngine(sys.argv[1], layout, model_name="plugin-test") as kv:
    kv.store(tokens, caches, slots)
    assert kv.flush()
    empty = [torch.zeros_like(c) for c in caches]
    got = kv.retrieve(tokens, empty, slots)
    blocks = {TOKENS} // {BLOCK}
    print(json.dumps({{"tiers": kv.tier_names, "retrieved": got, "root": kv.config.plainfiles_root,
                      "exact": all(torch.equal(a[:, :blocks], b[:, :blocks]) for a, b in zip(empty, caches)),
                      "caches": [c.tolist() for c in caches]}}))
"""

CONFIG = """
import json, sys
from kvlayer.config import ConfigError, KVLayerConfig
try:
    config = KVLayerConfig.load(sys.argv[1])
    out = {"section": dict(config.tiers["plainfiles"]), "flat": config.to_dict()["plainfiles_root"]}
except ConfigError as e:
    out = {"error": str(e)}
out["torch"] = "torch" in sys.modules
print(json.dumps(out))
"""


def install(target: Path) -> Path:
    """Install tests/tier_plugin into ``target`` as pip would (metadata, entry points, modules)."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    info = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = [f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items())
              for group, eps in project["entry-points"].items()]
    (info / "entry_points.txt").write_text("\n".join(groups))
    for module in PLUGIN.glob("*.py"):
        shutil.copy(module, target)
    return target


def run(site: Path, code: str, config: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    out = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=180,
                         cwd=site, env={**clean, "PYTHONPATH": str(site), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected_chunk(caches: list[torch.Tensor], i: int) -> torch.Tensor:
    """Chunk ``i`` as kvlayer lays it out: ``[layers, 2, chunk tokens, heads, head_dim]`` (slots 0, 1, ...)."""
    flat = [c.reshape(2, -1, HEADS, HEAD_DIM)[:, i * CHUNK:(i + 1) * CHUNK] for c in caches]
    return torch.stack(flat)


def test_a_tier_installed_from_a_distribution_gets_its_setting_from_yaml(tmp_path: Path) -> None:
    site, root = install(tmp_path / "site"), tmp_path / "chunks"
    config = tmp_path / "kvlayer.yaml"
    config.write_text(f"chunk_size: {CHUNK}\ncpu_capacity: 0\ntiers:\n  plainfiles:\n    root: {root}\n")
    got = run(site, ENGINE, config)
    assert got["tiers"] == ["plainfiles"] and got["root"] == str(root)
    assert got["retrieved"] == TOKENS and got["exact"]
    files = sorted(root.glob("*.chunk"))
    assert len(files) == TOKENS // CHUNK, "the tier wrote into the folder its own setting names"
    caches = [torch.tensor(c) for c in got["caches"]]
    bodies = {f.read_bytes()[16:] for f in files}
    want = {expected_chunk(caches, i).contiguous().view(torch.uint8).numpy().tobytes() for i in range(len(files))}
    assert bodies == want, "the files hold the chunks' exact bytes"


def test_the_tiers_section_and_its_flat_keys_are_one_setting(tmp_path: Path) -> None:
    site = install(tmp_path / "site")
    config = tmp_path / "kvlayer.yaml"
    config.write_text("tiers:\n  plainfiles:\n    root: /from/yaml\n")
    got = run(site, CONFIG, config)
    assert got == {"section": {"root": "/from/yaml"}, "flat": "/from/yaml", "torch": False}, \
        "a config loads the tier's light settings module, never its backend"
    assert run(site, CONFIG, config, KVLAYER_PLAINFILES_ROOT="/from/env")["flat"] == "/from/env"
    config.write_text("plainfiles_root: /flat\n")
    assert run(site, CONFIG, config)["section"] == {"root": "/flat"}


def test_an_unknown_key_in_a_tiers_section_is_one_line_naming_the_tier_and_key(tmp_path: Path) -> None:
    site = install(tmp_path / "site")
    config = tmp_path / "kvlayer.yaml"
    config.write_text("tiers:\n  plainfiles:\n    rooot: /x\n")
    error = run(site, CONFIG, config)["error"]
    assert "\n" not in error and "'rooot'" in error and "'plainfiles'" in error and "tiers.plainfiles.rooot" in error
    assert "['root']" in error, "the message lists the keys the tier declares"
