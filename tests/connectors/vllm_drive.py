"""Starting ``tests/connectors/vllm_driver.py`` from a test: one vLLM engine per process, its
JSON answer read back, and whatever it leaves behind killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def drive(spec: dict[str, Any], tmp: Path, mp: bool = False, background: bool = False,
          env: dict[str, str] | None = None) -> Any:
    """Run one engine on ``spec``; its JSON result (or, ``background``, the process). ``mp``:
    vLLM's multiprocessing mode (the engine core in a process of its own); ``env``: more
    variables. The driver runs in a session of its own, and ``result`` kills what is left of it
    (vLLM's engine-core and worker processes) once it has answered."""
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if mp else "0",
           "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "tests.connectors.vllm_driver", str(path)]
    logs = Path(f"{path}.out"), Path(f"{path}.err")
    with logs[0].open("w") as out, logs[1].open("w") as err:  # files: lingering children hold no pipe
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
    proc.logs = logs  # type: ignore[attr-defined]
    return proc if background else result(proc)


def result(proc: subprocess.Popen[bytes], timeout: float = 600) -> Any:
    """The JSON answer of a driver ``drive`` started in the background (its last JSON line);
    fails the test with the driver's stderr if it did not answer."""
    out, err = proc.logs  # type: ignore[attr-defined]
    try:
        proc.wait(timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # the answer is the last JSON object line: vLLM's worker processes may log to stdout after it
    lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"the vLLM driver failed:\n{err.read_text()[-3000:]}"
    return json.loads(lines[-1])


def at_gate(proc: subprocess.Popen[bytes], gate: Path, timeout: float = 300) -> None:
    """Wait until the driver ``proc`` reached its round with ``"wait_for": gate`` (it wrote
    ``<gate>.ready``); fails the test if the driver stopped first or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while not Path(str(gate) + ".ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the driver stopped before the gate"
        time.sleep(0.1)
