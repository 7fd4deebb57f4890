"""pyproject.toml: setuptools reads it without a deprecation warning (``project.license`` is an
SPDX string, not the deprecated table)."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_an_spdx_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_setuptools_applies_the_project_table_without_warnings(monkeypatch):
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # the readme and package folders are relative to the project
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    messages = [str(w.message) for w in caught if "license" in str(w.message).lower()]
    assert messages == [] and dist.metadata.license_expression == "Apache-2.0"
