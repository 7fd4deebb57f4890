"""Every ``bash`` block of docs/*.md runs, in order, per file, at small scale: docs cannot drift.

Each file's blocks run in one bash process (``set -euo pipefail``) in a fresh folder, with the
installed ``kvlayer`` first on PATH, ``KVLAYER_HOME`` in that folder and ``KVLAYER_SMOKE=1``,
which the benchmarks honour by shrinking their workloads (the commands and flags are the
documented ones). The controller's documented address ``127.0.0.1:50051``, the server's
``127.0.0.1:8000`` and the router's ``127.0.0.1:8080`` (and ``--port N``) are replaced by free
ports. Background jobs a block starts (``&``) are killed when the file is done. Blocks in other
languages (yaml, python, text) are not run; Python examples are exercised by the unit tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def bash_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_docs_exist_and_link_each_other():
    names = {p.name for p in DOCS}
    assert {"architecture.md", "configuration.md", "tiers.md", "admin-api.md", "benchmarks.md",
            "operations.md"} <= names
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert f"docs/{name}" in readme, f"README must link docs/{name}"


def test_configuration_lists_every_key():
    from dataclasses import fields

    from kvlayer.config import KVLayerConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    for f in fields(KVLayerConfig):
        assert f"| `{f.name}` | `KVLAYER_{f.name.upper()}` |" in text, f"docs/configuration.md lacks {f.name}"


SLOW_DOCS = {"benchmarks.md"}
"""Docs whose commands take minutes even at smoke scale (benchmarks.md: 110 s on 2 cores), run
with ``-m slow``; each command there also has its own smoke test under tests/benchmarks."""


@pytest.mark.parametrize("doc", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_DOCS else p
                                 for p in DOCS if bash_blocks(p)], ids=lambda p: p.name)
def test_every_command_in_the_docs_runs(doc: Path, tmp_path: Path):
    ports = {"127.0.0.1:50051": free_port(), "127.0.0.1:8000": free_port(),  # controller, kvlayer serve,
             "127.0.0.1:8080": free_port()}  # kvlayer router
    script = "\n".join(bash_blocks(doc))
    for documented, port in ports.items():
        script = script.replace(documented, f"127.0.0.1:{port}")
        script = script.replace(f"--port {documented.rsplit(':', 1)[1]}", f"--port {port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "KVLAYER_HOME": str(tmp_path / "home"), "KVLAYER_SMOKE": "1",
           "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("KVLAYER_") or k in
           ("KVLAYER_HOME", "KVLAYER_SMOKE")}
    cleanup = "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"  # also when a command fails
    proc = subprocess.Popen(["bash", "-c", f"set -euo pipefail\n{cleanup}\n{script}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{doc.name}: a documented command failed:\n{out[-4000:]}"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_the_readmes_engine_agnostic_snippet_runs_as_written():
    (snippet,) = [b for b in python_blocks(ROOT / "README.md") if "KVCacheEngine(" in b]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "512\n"


def test_documented_config_commands_are_the_real_cli():
    """Every ``kvlayer config ...`` the README and docs/configuration.md show parses, and both
    show the same flags."""
    import shlex

    from kvlayer.cli import build_parser

    flags = {}
    for name in ("README.md", "docs/configuration.md"):
        commands = re.findall(r"kvlayer config\b[^`\n]*", (ROOT / name).read_text())
        assert commands, name
        for command in commands:
            argv = [w for w in shlex.split(command) if "=" not in w][1:]
            assert build_parser().parse_args(argv).func.__name__ == "_config", command
        flags[name] = {w for c in commands for w in c.split() if w.startswith("--")}
    assert {"--file", "--show"} <= flags["README.md"] & flags["docs/configuration.md"]
    assert "--check" in flags["docs/configuration.md"] and "`--check`" in (ROOT / "README.md").read_text()


def test_every_kvlayer_variable_that_is_not_a_config_key_is_documented():
    from kvlayer.config import _NOT_CONFIG

    text = (ROOT / "docs" / "configuration.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in _NOT_CONFIG:
        assert f"`{name}" in text, f"docs/configuration.md lacks {name}"
    for name in ("KVLAYER_HOME", "KVLAYER_LOG_LEVEL", "KVLAYER_SMOKE", "kvlayer demo", "kvlayer --version"):
        assert name in readme, f"README.md lacks {name}"


def test_the_readme_says_how_the_headline_figures_were_measured():
    text = " ".join((ROOT / "README.md").read_text().split())
    headline = text[text.index("55x faster") - 200:text.index("55x faster") + 100]
    for condition in ("random-weight", "float32", "2 CPU cores"):
        assert condition in headline, condition


def test_the_readme_set_up_is_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Two commands"):readme.index("## Using it")]
    (block,) = BLOCK.findall(section)
    assert len([line for line in block.splitlines() if line.strip() and not line.startswith("#")]) == 2
