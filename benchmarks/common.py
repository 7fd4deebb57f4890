"""Shared pieces of the benchmarks: the default model, machine and model facts, progress bars,
tables, JSON output and figures (every figure carries the machine, model and settings it was
measured with)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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


def model_facts(model: str, device: str = "cpu") -> dict[str, Any]:
    """The model folder ``model`` as recorded next to every figure: name, shape, vocabulary, KV
    dtype (the engine's default: float32 on the CPU, bfloat16 elsewhere) and KV bytes per token."""
    from kvlayer.engine.model_config import load_model_config

    cfg = load_model_config(model)
    dtype, elem = ("float32", 4) if device == "cpu" else ("bfloat16", 2)
    return {"path": str(model), "name": cfg.model_name, "architecture": cfg.architecture,
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "dtype": dtype,
            "kv_bytes_per_token": cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line settings of a run as plain data (the handler and paths left out)."""
    from kvlayer.benchmarks.configs import redact_url

    skip = {"func", "bench_module", "json", "plot", "verbose"}
    out = {k: v for k, v in sorted(vars(args).items()) if k not in skip and not callable(v)}
    if out.get("redis_url"):
        out["redis_url"] = redact_url(out["redis_url"])
    return out


def add_plot_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", help="also draw the results into this PNG file (matplotlib)")


@contextmanager
def progress(total: int, description: str) -> Iterator[Any]:
    """A progress bar on stderr over ``total`` steps; yields a callable ``advance(n=1)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


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
    """Write ``payload`` as indented JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def save_figure(fig: Any, path: str | None, record: dict[str, Any], setup: str = "") -> None:
    """Save a matplotlib figure as PNG with a footer naming the machine and model of ``record``
    (the ``machine``/``model`` keys a benchmark writes to JSON) and ``setup``, a one-line summary
    of the configuration measured. Nothing happens when ``path`` is None."""
    if not path:
        return
    m, model = record.get("machine", {}), record.get("model", {})
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    footer = (f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores{gpu}), torch {m.get('torch', '?')}; "
              f"model {model.get('name', '?')} ({model.get('layers', '?')} layers, {model.get('dtype', '?')}); "
              f"{m.get('date', '')}" + (f"\n{setup}" if setup else ""))
    fig.text(0.01, 0.005, footer, fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.06 if setup else 0.03, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    print(f"wrote {path}")


def new_figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (11, 4.5)) -> tuple[Any, Any]:
    """A matplotlib figure and its axes, on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    return fig, axes


def close_figure(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def timed(fn, *args, **kw) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t, out


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]
