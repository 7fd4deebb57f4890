"""The ``kvlayer`` command line: ``kvlayer model init``, ``kvlayer demo``, ``kvlayer config``,
``kvlayer bench ...``, ``kvlayer serve``, ``kvlayer router``, ``kvlayer controller``, ``kvlayer admin ...``,
``kvlayer cache-server``.

This module is the composition root: each subcommand imports the parts it wires together
when it runs, so ``kvlayer --help`` stays fast and needs no optional dependency.

Errors are one line on stderr and exit 2: a bad flag (checked while parsing, before any model
is made or engine built), a bad config value or file, an unusable model folder or device.
``KVLAYER_LOG_LEVEL`` (debug, info, warning, error; default warning, ``-v`` = info) sets the
log level; ``KVLAYER_SMOKE=1`` shrinks the documented benchmark commands (see ``SMOKE``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

Handler = Callable[[argparse.Namespace], int]
BAD_FILE_ERRORS: tuple[type[OSError], ...] = (FileNotFoundError, FileExistsError, PermissionError,
                                              IsADirectoryError, NotADirectoryError)
"""A file named on the command line (a token, tokens or config file, a model folder to write)
that cannot be read or written: a bad argument (one line, exit 2), not a crash."""
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class UsageError(Exception):
    """A bad command line: the one line ``main`` prints (``PROG: error: MESSAGE``) before exiting 2."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line (no usage block), raised for ``main`` to print;
    subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


def _model_init(args: argparse.Namespace) -> int:
    from kvlayer.engine.presets import init_model

    layer_types = tuple(args.layer_types.split(",")) if args.layer_types else None
    path = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, architecture=args.arch,
                      sliding_window=args.sliding_window, max_window_layers=args.max_window_layers,
                      layer_types=layer_types)
    window = f", window {args.sliding_window}" if args.sliding_window else ""
    print(f"wrote a random-weight '{args.preset}' {args.arch} model{window} to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvlayer.benchmarks.demo import run_demo

    return run_demo(args)


def _config(args: argparse.Namespace) -> int:
    import yaml

    from kvlayer import capacity, places
    from kvlayer.config import KVLayerConfig

    config = KVLayerConfig.load(args.file)  # every tier's section checked against its declaration here
    if args.show or not args.check:  # flat keys: what `--file` takes back, each tier's settings as <tier>_<key>
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    if not args.check:
        return 0
    # memory first (no I/O), then each tier's place, written flat (nvme_path) or in its section
    problems = [*capacity.problems(config, None), *(u.reason for u in places.unusable(config))]
    for problem in problems:
        print(f"kvlayer: error: {problem}", file=sys.stderr)
    if not problems:
        tried = places.places(config)
        logging.getLogger(__name__).info("kvlayer config: %s", capacity.describe(config))  # with -v
        print(f"kvlayer config: {' and '.join(tried)} usable" if tried else
              f"kvlayer config: no {' or '.join(places.declared_places())} to try")
    return 2 if problems else 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"kvlayer.benchmarks.{args.bench_module}")
    return module.main(args)


def build_parser() -> argparse.ArgumentParser:
    from kvlayer.benchmarks.common import device_name, nonnegative_int, positive_int

    home = os.environ.get("KVLAYER_HOME", ".kvlayer")
    p = _Parser(prog="kvlayer", description="kvlayer: a tiered KV cache layer for LLM inference",
                epilog="environment: KVLAYER_HOME (models and caches, default .kvlayer), KVLAYER_LOG_LEVEL "
                       "(debug, info, warning, error), KVLAYER_* config keys (see kvlayer config)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--version", action="version", version=f"kvlayer {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    init = model.add_parser("init", help="write a random-weight model folder (config.json + safetensors)")
    init.add_argument("--preset", choices=("tiny", "small", "bench"), default="tiny")
    init.add_argument("--out", required=True, help="folder to write")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    init.add_argument("--arch", default="llama", choices=("llama", "qwen2", "mistral"))
    init.add_argument("--sliding-window", type=positive_int, help="a sliding window of this many tokens "
                      "(mistral: every layer; qwen2: the layers --max-window-layers or --layer-types name)")
    init.add_argument("--max-window-layers", type=nonnegative_int, default=0,
                      help="qwen2: this many first layers stay full attention, the rest slide")
    init.add_argument("--layer-types", help="qwen2: each layer's kind, comma-separated "
                                            "(sliding_attention or full_attention)")
    init.set_defaults(func=_model_init)

    demo = sub.add_parser("demo", help="a multi-turn chat through the engine, with and without kvlayer")
    demo.add_argument("--model", help="model folder (default: a random 'bench' model made once)")
    demo.add_argument("--home", default=home, help="where made models and the disk cache live")
    demo.add_argument("--device", type=device_name, default="cpu")
    demo.add_argument("--turns", type=positive_int, default=4)
    demo.add_argument("--kv-config", type=_config_file,
                      help="kvlayer YAML config (default: CPU + disk tiers under --home)")
    demo.set_defaults(func=_demo)

    config = sub.add_parser("config", help="print (or --check) the kvlayer configuration in effect "
                                           "(file + KVLAYER_* variables)")
    config.add_argument("--file", help="a kvlayer YAML config (default: the defaults); a tier's settings are "
                                       "flat keys (nvme_path) or its section (tiers: {nvme: {path: ...}})")
    config.add_argument("--show", action="store_true", help="print it, each tier's settings as flat <tier>_<key> "
                                                             "keys (the default, unless --check alone)")
    config.add_argument("--check", action="store_true",
                        help="compare its memory sizes (cpu_capacity, gpu_capacity, staging_capacity) with the "
                             "machine's, and try its nvme_path (write and remove a probe file) and redis_url (a "
                             "PING within tier_timeout_ms), in either spelling; exit 2 with one line per problem")
    config.set_defaults(func=_config)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_bench(bench, "engine", "engine_bench", "prefill and decode throughput vs transformers", home)
    _add_bench(bench, "ttft", "ttft", "time to first token: recompute vs each kvlayer tier", home)
    _add_bench(bench, "tiers", "tiers", "get/put throughput of each tier vs its raw ceiling", home)
    _add_bench(bench, "bounds", "tier_bounds", "the steps bench tiers's engine rows cannot skip, and the best "
                                               "ratio they allow", home)
    _add_bench(bench, "multi-round-qa", "multi_round_qa", "chat users over a working set > the engine's KV", home)
    _add_bench(bench, "long-doc-qa", "long_doc_qa", "documents queried again, hits from the lower tiers", home)
    _add_bench(bench, "miss-overhead", "miss_overhead", "kvlayer's TTFT overhead when nothing ever hits", home)
    _add_bench(bench, "vllm", "vllm_bench", "TTFT inside vLLM: its own caches vs kvlayer's tiers", home)
    _add_bench(bench, "cache-server", "cache_server_bench", "the node cache server vs an in-process CPU tier, "
                                                           "and across an engine restart", home)
    _add_bench(bench, "cache-server-mrqa", "cache_server_mrqa", "multi-round QA over 2 engines: one shared cache "
                                                                 "server vs a private CPU tier each", home)
    _add_bench(bench, "fleet", "fleet_bench", "a fleet through the router: KV-aware routing vs round-robin/random, P/D",
               home)
    _add_bench(bench, "peer", "peer_lmcache", "kvlayer vs LMCache 0.5.6 side by side (builds its own venv)", home)
    __import__("kvlayer.serving.cli", fromlist=["add_command"]).add_command(sub)  # serve
    __import__("kvlayer.router.cli", fromlist=["add_command"]).add_command(sub)  # router
    __import__("kvlayer.controller.cli", fromlist=["add_commands"]).add_commands(sub)  # controller, admin
    __import__("kvlayer.cacheserver.cli", fromlist=["add_command"]).add_command(sub)  # cache-server
    return p


def _add_bench(sub: argparse._SubParsersAction, name: str, module: str, help_: str, home: str) -> None:
    import importlib

    from kvlayer.benchmarks.common import device_name, output_path

    b = sub.add_parser(name, help=help_)
    b.add_argument("--model", help="model folder (default: a random 'bench' model made once)")
    b.add_argument("--home", default=home)
    b.add_argument("--device", type=device_name, default="cpu")
    b.add_argument("--json", type=output_path, help="also write the results as JSON to this path")
    b.set_defaults(func=_bench, bench_module=module)
    importlib.import_module(f"kvlayer.benchmarks.{module}").add_arguments(b)


SMOKE: dict[str, list[str]] = {
    "ttft": ["--lengths", "128,256", "--suffix", "8", "--chunk-size", "64"],
    "multi-round-qa": ["--users", "3", "--rounds", "2", "--system-tokens", "128", "--history-tokens", "128",
                       "--question-tokens", "16", "--answer-tokens", "4", "--chunk-size", "64", "--rate", "20"],
    "long-doc-qa": ["--docs", "3", "--doc-tokens", "256", "--queries", "2", "--question-tokens", "8",
                    "--answer-tokens", "2", "--chunk-size", "64"],
    "engine": ["--lengths", "64", "--decode-seqs", "2", "--decode-prompt", "32", "--decode-tokens", "4"],
    "miss-overhead": ["--length", "64", "--rounds", "2", "--chunk-size", "32"],
    "bounds": ["--preset", "tiny", "--tokens", "256", "--chunk-tokens", "64", "--repeat", "1"],
    "fleet": ["--users", "3", "--rounds", "3", "--system-tokens", "32", "--history-tokens", "96",
              "--question-tokens", "8", "--answer-tokens", "4", "--chunk-size", "16", "--rate", "4",
              "--policies", "kv", "--no-pd"],
}
"""Flags appended to ``kvlayer bench <name>`` when ``KVLAYER_SMOKE=1`` (with a ``tiny`` model unless
``--model`` is given): the documented commands, run by the docs test at a size CI affords."""


def _smoking(argv: list[str]) -> bool:
    """Whether to shrink this command: a documented in-process bench under ``KVLAYER_SMOKE=1``
    (a run against ``--endpoint`` is sized by its own flags and refuses the in-process ones)."""
    return (os.environ.get("KVLAYER_SMOKE") == "1" and len(argv) >= 2 and argv[0] == "bench" and argv[1] in SMOKE
            and not any(w == "--endpoint" or w.startswith("--endpoint=") for w in argv))


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    smoke = _smoking(words)
    try:
        args = build_parser().parse_args([*words, *SMOKE[words[1]]] if smoke else words)
        level = logging.INFO if args.verbose else _log_level(os.environ.get("KVLAYER_LOG_LEVEL", "warning"))
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if smoke and args.model is None:  # made once the flags are known to be good
            from kvlayer.benchmarks.common import default_model

            args = argparse.Namespace(**{**vars(args), "model": default_model(args.home, "tiny")})
        return args.func(args)
    except (ValueError, *BAD_FILE_ERRORS) as e:
        print(f"kvlayer: error: {e}", file=sys.stderr)
        return 2


# ----- flag values checked while parsing ---------------------------------------------------
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvlayer")
    except PackageNotFoundError:
        return "(not installed: no package metadata)"


def _log_level(name: str) -> int:
    try:
        return LOG_LEVELS[name.strip().lower()]
    except KeyError:
        raise UsageError(f"kvlayer: error: KVLAYER_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, "
                         f"got {name!r}") from None


def _config_file(text: str) -> str:
    """A kvlayer YAML config that loads (the text is kept)."""
    from kvlayer.config import KVLayerConfig

    try:
        KVLayerConfig.load(text)
    except (ValueError, *BAD_FILE_ERRORS) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


if __name__ == "__main__":
    sys.exit(main())
