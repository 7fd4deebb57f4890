"""Every ``bash`` block of docs/*.md runs, in order, per file, at small scale: docs cannot drift.

Each file's blocks run in one bash process (``set -euo pipefail``) in a fresh folder, with the
installed ``kvlayer`` first on PATH, ``KVLAYER_HOME`` in that folder and ``KVLAYER_SMOKE=1``,
which the benchmarks honour by shrinking their workloads (the commands and flags are the
documented ones). The controller's documented address ``127.0.0.1:50051`` is replaced by a free
port. Background jobs a block starts (``&``) are killed when the file is done. Blocks in other
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


@pytest.mark.parametrize("doc", [p for p in DOCS if bash_blocks(p)], ids=lambda p: p.name)
def test_every_command_in_the_docs_runs(doc: Path, tmp_path: Path):
    port = free_port()
    script = "\n".join(b.replace("127.0.0.1:50051", f"127.0.0.1:{port}") for b in bash_blocks(doc))
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
