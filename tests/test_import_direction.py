"""Imports go one way (docs/architecture.md section 1); importing kvlayer stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folder -> kvlayer subpackages it must never import
FORBIDDEN = {
    "kvlayer": ("kvlayer.engine", "kvlayer.connectors", "kvlayer.backends", "kvlayer.controller",
                "kvlayer.benchmarks"),
    "engine": ("kvlayer.backends", "kvlayer.controller", "kvlayer.benchmarks",
               "kvlayer.connectors.kvlayer_connector", "kvlayer.cache_engine", "kvlayer.tier_manager"),
    "backends": ("kvlayer.engine", "kvlayer.connectors", "kvlayer.controller", "kvlayer.benchmarks"),
    "controller": ("kvlayer.engine", "kvlayer.connectors", "kvlayer.backends", "kvlayer.benchmarks"),
    "connectors": ("kvlayer.engine", "kvlayer.benchmarks"),
    "serving": ("kvlayer.backends", "kvlayer.controller", "kvlayer.benchmarks", "kvlayer.cache_engine",
                "kvlayer.tier_manager", "kvlayer.connectors.kvlayer_connector"),
    # The router holds no KV: of serving it shares only the light modules (http, listener,
    # protocol, metrics, chat). The engine's tokenizer is imported lazily for --tokenizer, so
    # tests/router/test_router_imports.py checks at run time that the engine stays out.
    "router": ("kvlayer.backends", "kvlayer.benchmarks", "kvlayer.connectors",
               "kvlayer.cache_engine", "kvlayer.tier_manager", "kvlayer.serving.app", "kvlayer.serving.cli",
               "kvlayer.serving.completions", "kvlayer.serving.engine_loop", "kvlayer.serving.generation",
               "kvlayer.serving.text"),
}
# The CLI is the composition root: it wires every part together, lazily, per subcommand.
EXEMPT = {ROOT / "kvlayer" / "cli.py"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_imports_go_one_way():
    bad = []
    for folder, forbidden in FORBIDDEN.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path in EXEMPT or "_pb2" in path.name:
                continue
            for mod in imported_modules(path):
                if mod.startswith(forbidden):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_pickle_in_the_data_path():
    users = []
    for folder in ("kvlayer", "backends", "controller", "connectors", "engine"):
        for path in (ROOT / folder).rglob("*.py"):
            mods = imported_modules(path)
            if {"pickle", "cPickle", "dill", "cloudpickle"} & mods:
                users.append(str(path.relative_to(ROOT)))
    assert not users


def test_importing_kvlayer_is_light():
    code = ("import sys, kvlayer, kvlayer.cache_engine, kvlayer.connectors.kvlayer_connector;"
            "heavy = [m for m in ('redis', 'transformers', 'triton', 'grpc', 'matplotlib') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_command_line_is_built_without_torch():
    code = ("import sys; from kvlayer.cli import build_parser; build_parser();"
            "print([m for m in ('torch', 'grpc', 'fastapi', 'httpx', 'redis') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_bench_tiers_preset_names_are_the_engines():
    from kvlayer.benchmarks.tiers import PRESET_NAMES
    from kvlayer.engine.presets import PRESETS

    assert sorted(PRESET_NAMES) == sorted(PRESETS)
