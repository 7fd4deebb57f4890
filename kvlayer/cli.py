"""The ``kvlayer`` command line: ``kvlayer model init``, ``kvlayer demo``, ``kvlayer bench ...``.

This module is the composition root: each subcommand imports the parts it wires together
when it runs, so ``kvlayer --help`` stays fast and needs no optional dependency.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]
BAD_FILE_ERRORS: tuple[type[OSError], ...] = (FileNotFoundError, PermissionError, IsADirectoryError,
                                              NotADirectoryError)
"""A file named on the command line (a token, tokens or config file) that cannot be read: a bad
argument (one line, exit 2), not a crash."""


def _model_init(args: argparse.Namespace) -> int:
    from kvlayer.engine.presets import init_model

    path = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, architecture=args.arch)
    print(f"wrote a random-weight '{args.preset}' {args.arch} model to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvlayer.benchmarks.demo import run_demo

    return run_demo(args)


def _config(args: argparse.Namespace) -> int:
    import yaml

    from kvlayer.config import KVLayerConfig

    print(yaml.safe_dump(KVLayerConfig.load(args.file).to_dict(), sort_keys=False), end="")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"kvlayer.benchmarks.{args.bench_module}")
    return module.main(args)


def build_parser() -> argparse.ArgumentParser:
    home = os.environ.get("KVLAYER_HOME", ".kvlayer")
    p = argparse.ArgumentParser(prog="kvlayer", description="kvlayer: a tiered KV cache layer for LLM inference")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    init = model.add_parser("init", help="write a random-weight model folder (config.json + safetensors)")
    init.add_argument("--preset", choices=("tiny", "small", "bench"), default="tiny")
    init.add_argument("--out", required=True, help="folder to write")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    init.add_argument("--arch", default="llama", choices=("llama", "qwen2", "mistral"))
    init.set_defaults(func=_model_init)

    demo = sub.add_parser("demo", help="a multi-turn chat through the engine, with and without kvlayer")
    demo.add_argument("--model", help="model folder (default: a random 'small' model made once)")
    demo.add_argument("--home", default=home, help="where made models and the disk cache live")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--kv-config", help="kvlayer YAML config (default: CPU + disk tiers under --home)")
    demo.set_defaults(func=_demo)

    config = sub.add_parser("config", help="print the kvlayer configuration in effect (file + KVLAYER_* variables)")
    config.add_argument("--file", help="a kvlayer YAML config (default: the defaults)")
    config.add_argument("--show", action="store_true", help="print it (the default action)")
    config.set_defaults(func=_config)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    _add_bench(bench, "engine", "engine_bench", "prefill and decode throughput vs transformers", home)
    _add_bench(bench, "ttft", "ttft", "time to first token: recompute vs each kvlayer tier", home)
    _add_bench(bench, "tiers", "tiers", "get/put throughput of each tier vs its raw ceiling", home)
    _add_bench(bench, "multi-round-qa", "multi_round_qa", "chat users over a working set > the engine's KV", home)
    _add_bench(bench, "long-doc-qa", "long_doc_qa", "documents queried again, hits from the lower tiers", home)
    _add_bench(bench, "miss-overhead", "miss_overhead", "kvlayer's TTFT overhead when nothing ever hits", home)
    __import__("kvlayer.controller.cli", fromlist=["add_commands"]).add_commands(sub)  # controller, admin
    return p


def _add_bench(sub: argparse._SubParsersAction, name: str, module: str, help_: str, home: str) -> None:
    import importlib

    b = sub.add_parser(name, help=help_)
    b.add_argument("--model", help="model folder (default: a random 'bench' model made once)")
    b.add_argument("--home", default=home)
    b.add_argument("--device", default="cpu")
    b.add_argument("--json", help="also write the results as JSON to this path")
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
}
"""Flags appended to ``kvlayer bench <name>`` when ``KVLAYER_SMOKE=1`` (with a ``tiny`` model unless
``--model`` is given): the documented commands, run by the docs test at a size CI affords."""


def _smoke(argv: list[str]) -> list[str]:
    if os.environ.get("KVLAYER_SMOKE") != "1" or len(argv) < 2 or argv[0] != "bench" or argv[1] not in SMOKE:
        return argv
    extra = list(SMOKE[argv[1]])
    if "--model" not in argv and "-h" not in argv and "--help" not in argv:
        from kvlayer.benchmarks.common import default_model

        home = argv[argv.index("--home") + 1] if "--home" in argv else os.environ.get("KVLAYER_HOME", ".kvlayer")
        extra += ["--model", default_model(home, "tiny")]
    return [*argv, *extra]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_smoke(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, *BAD_FILE_ERRORS) as e:
        print(f"kvlayer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
