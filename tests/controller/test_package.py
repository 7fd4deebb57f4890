"""The ``kvlayer.controller`` package imports none of its modules: each of them imports the
package (for the generated ``controller_pb2``), so one imported back, even inside a function,
would be an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_init_imports_none_of_its_modules():
    tree = ast.parse((ROOT / "controller" / "__init__.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("kvlayer.controller") or m == ""], imported


def test_best_instance_lives_in_the_client():
    from kvlayer.controller.client import best_instance

    assert callable(best_instance)
