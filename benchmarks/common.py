"""Shared pieces of the benchmarks: the default model, machine facts, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def default_model(home: str, preset: str = "bench", seed: int = 0) -> str:
    """A random-weight model folder of ``preset`` under ``home``, made on first use."""
    from kvlayer.engine.presets import init_model

    path = Path(home) / "models" / f"{preset}-{seed}"
    if not (path / "config.json").exists():
        print(f"making a random '{preset}' model in {path} (once)")
        init_model(preset, path, seed=seed)
    return str(path)


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """CPU, core count, GPU and torch version, recorded next to every figure."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A readable table on stdout (rich when the terminal allows, plain text otherwise)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(str(c), justify="right")
    for r in rows:
        table.add_row(*[_fmt(v) for v in r])
    Console(width=max(100, sum(len(str(c)) + 6 for c in columns))).print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def timed(fn, *args, **kw) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t, out


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]
