"""Shared pieces of the benchmarks: the default model, machine and model facts, progress bars,
tables, JSON output and figures (every figure carries the machine, model and settings it was
measured with), and the ``type=`` functions that check every flag while it is parsed."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvlayer.flags import positive_float as positive_float  # re-exported: the benchmarks' flag types
from kvlayer.sizes import parse_size


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
    dtype (the engine's default: float32 on the CPU, bfloat16 elsewhere), each layer's sliding window
    (None: full attention) and KV bytes per token."""
    from kvlayer.engine.model_config import load_model_config

    cfg = load_model_config(model)
    dtype, elem = ("float32", 4) if device == "cpu" else ("bfloat16", 2)
    return {"path": str(model), "name": cfg.model_name, "architecture": cfg.architecture,
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "dtype": dtype,
            "layer_windows": list(cfg.layer_windows),
            "kv_bytes_per_token": cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line settings of a run as plain data (the handler and paths left out)."""
    skip = {"func", "bench_module", "json", "plot", "verbose"}
    out = {k: v for k, v in sorted(vars(args).items()) if k not in skip and not callable(v)}
    if out.get("redis_url"):
        out["redis_url"] = redact_url(out["redis_url"])
    return out


def redact_url(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***" if parts.username else ":***"
    host = parts.hostname or ""
    netloc = f"{user}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def add_plot_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", type=output_path, help="also draw the results into this PNG file (matplotlib)")


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


def parse_ints(text: str, minimum: int | None = None) -> list[int]:
    """The comma-separated integers of ``text`` ("128,256"); ValueError for an empty list, an
    empty item ("1,,2"), a word, or (with ``minimum``) a number below ``minimum``."""
    items = [x.strip() for x in text.split(",")]
    if items == [""]:
        raise ValueError("expected comma-separated integers, got nothing")
    if "" in items:
        raise ValueError(f"empty item in {text!r}")
    return [_integer(x, minimum) for x in items]


def _integer(text: str, minimum: int | None) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {n}")
    return n


# ----- command-line values -----------------------------------------------------------------
# ``type=`` functions for the benchmarks' flags: argparse calls them while parsing, before any
# model is made or engine built, and reports an error as one line naming the flag
# ("argument --lengths: not an integer: 'abc'"). Those that check a text the benchmark parses
# again later (a size, a configuration list) return it unchanged, so settings record it as typed.
def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _checked(lambda: _integer(text, 1))


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _checked(lambda: _integer(text, 0))


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1 ("128,256"): no empty item, at least one."""
    return _checked(lambda: parse_ints(text, minimum=1))


def checked_text(parse: Callable[[str], object]) -> Callable[[str], str]:
    """A ``type=`` function that checks a flag's text with ``parse`` (its ValueError is the
    error argparse reports) and keeps the text, for a value the benchmark parses later."""
    def check(text: str) -> str:
        _checked(lambda: parse(text))
        return text

    return check


size_text = checked_text(parse_size)
"""A byte size ("512MiB", "4GiB", "1000000"), checked; the text is kept."""


def size_or_auto(text: str) -> str:
    """``auto`` (the benchmark sizes it) or a byte size, checked; the text is kept."""
    return text if text == "auto" else size_text(text)


def device_name(text: str) -> str:
    """A torch device this machine can run the engine on ("cpu", "cuda", "cuda:1"), checked;
    the text is kept."""
    from kvlayer.engine.config import parse_device

    _checked(lambda: parse_device(text))
    return text


def output_path(text: str) -> str:
    """A file path a result can be written to at the end of a run: not a folder, and a file
    can be made in its nearest existing parent (a probe file, removed at once; missing parents
    are made when the result is written). The text is kept."""
    import tempfile

    path = Path(text).expanduser().absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    parent = next(p for p in path.parents if p.exists())
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".kvlayer-probe-"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e} ({parent})") from None
    return text


def _checked(parse: Callable[[], Any]) -> Any:
    """``parse()``, its ValueError turned into argparse's type error (same message)."""
    try:
        return parse()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
