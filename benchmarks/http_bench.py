"""The HTTP mode of ``kvlayer bench multi-round-qa`` and ``long-doc-qa`` (``--endpoint URL``).

The bench drives any OpenAI-compatible server (``kvlayer serve``, ``vllm serve``, vLLM with
LMCache) with its workload: real concurrent clients (asyncio + httpx, benchmarks/http_driver.py)
on the wall clock, each prompt sent as token ids to ``POST URL/v1/completions`` (so every server
sees identical prompts and no tokenizer is needed). Token ids are drawn from ``--vocab`` ids, or
the vocabulary of ``--model`` (a model folder); one of the two is needed. The model name is
``--served-model-name``, else the first id of ``GET URL/v1/models``; ``--api-key`` (default
``$OPENAI_API_KEY``) goes as a bearer token.

One run measures one server: to compare configurations, run the bench once per server, each
with its own ``--label``. The in-process flags (``--configs``, the tier capacities, ``--clock``
...) are refused with ``--endpoint`` when set to anything but their default, and the HTTP
flags are refused without it, so no run silently ignores a flag (``--home`` is unused over
HTTP). httpx is imported only by a run with ``--endpoint``, so the parser needs none.

A request that gets a non-2xx status or a broken stream counts as failed (its status and
first error message are in the table and the JSON) and the run goes on; if no measured
request succeeds, the bench exits 2 with one line naming the first failure's status and
message. A server that cannot be reached at the start: one line, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvlayer.benchmarks.common import (
    close_figure,
    machine_info,
    model_facts,
    new_figure,
    positive_float,
    positive_int,
    print_table,
    progress,
    redact_url,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.driver import Sessions
from kvlayer.benchmarks.workloads import Turn

if TYPE_CHECKING:  # httpx is imported when a run needs it, so the parser needs no httpx
    from kvlayer.benchmarks.http_driver import HttpRecord

HTTP_HELP = ("drive an OpenAI-compatible server at --endpoint instead of the in-process engine; "
             "in-process flags (--configs, tier capacities, --clock ...) are refused with it")


@dataclass(frozen=True, slots=True)
class HttpWorkload:
    """A bench's workload for the HTTP mode. ``build(vocab)`` returns the sessions and the
    (warm-up, measured) turns; ``users`` bounds the connections; ``extra(sessions, measured
    records)`` adds the bench's own figures (shown as table columns, kept under ``workload``);
    ``setup`` is the one-line description printed and put under the figure."""

    bench: str
    users: int
    answer_tokens: int
    build: Callable[[int], tuple[Sessions, list[Turn], list[Turn]]]
    setup: str
    extra: Callable[[Sessions, list[HttpRecord]], dict[str, Any]] | None = None


def endpoint_url(text: str) -> str:
    """An ``http://`` or ``https://`` base URL with a host (the server's root, without
    ``/v1``); returned without a trailing slash."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected a URL starting http:// or https://, got {text!r}")
    return text.rstrip("/")


def vocab_size(text: str) -> int:
    """An integer >= 4 (ids are drawn from [3, vocab))."""
    n = positive_int(text)
    if n < 4:
        raise argparse.ArgumentTypeError(f"must be >= 4 (ids are drawn from 3 up), got {n}")
    return n


def add_http_arguments(p: argparse.ArgumentParser, in_process: Sequence[str]) -> None:
    """The HTTP mode's flags. Call it after every other flag is added: ``in_process`` names the
    destinations of the flags the HTTP mode refuses, whose defaults are read from ``p`` then.
    ``args.http_flags(args)`` (a callable, so settings leave it out) raises ValueError for a
    flag that does not belong to the mode chosen."""
    g = p.add_argument_group("HTTP mode", HTTP_HELP)
    g.add_argument("--endpoint", type=endpoint_url,
                   help="base URL of an OpenAI-compatible server (http://host:port), without /v1")
    g.add_argument("--served-model-name", help="model name to request (default: the first of GET /v1/models)")
    g.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--vocab", type=vocab_size,
                   help="vocabulary size to draw token ids from (default: that of --model; one is needed)")
    g.add_argument("--label", help="name of this run in the table and JSON (default: the endpoint)")
    g.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds to wait for a connection or the next streamed chunk")
    http = ("served_model_name", "api_key", "vocab", "label", "timeout")
    p.set_defaults(http_flags=functools.partial(
        _check_flags, {d: p.get_default(d) for d in in_process}, {d: p.get_default(d) for d in http}))


def _check_flags(in_process: Mapping[str, Any], http: Mapping[str, Any], args: argparse.Namespace) -> None:
    wrong, needs = (in_process, "the in-process engine (not --endpoint)") if args.endpoint else (http, "--endpoint")
    for dest, default in wrong.items():
        if getattr(args, dest) != default:
            raise ValueError(f"--{dest.replace('_', '-')} needs {needs}")
    if args.endpoint and args.model and args.vocab:
        raise ValueError("--model and --vocab both set the vocabulary: give one")


def http_mode(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for the HTTP mode; ValueError for a flag of the other mode."""
    args.http_flags(args)
    return bool(args.endpoint)


def run_http(args: argparse.Namespace, work: HttpWorkload, in_process: Sequence[str]) -> int:
    """Run ``work`` against ``args.endpoint``: print the table, write ``--json`` and ``--plot``;
    0, or ValueError (exit 2) when the server cannot be reached or no measured request succeeds.
    ``in_process``: the settings left out of the record."""
    from kvlayer.benchmarks.http_driver import request_rows, summarize_http

    if args.model:
        model = model_facts(args.model)
    elif args.vocab:
        model = {"vocab": args.vocab}
    else:
        raise ValueError("--endpoint needs --vocab or --model (a model folder) for the token ids' range")
    sessions, warmup, turns = work.build(model["vocab"])
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    served, warm, measured = asyncio.run(_serve(args, work, sessions, warmup, turns, api_key))
    label = args.label or redact_url(args.endpoint)
    summary = summarize_http(label, measured)
    summary["warmup"] = summarize_http(label, warm)
    if work.extra is not None:
        summary["workload"] = work.extra(sessions, measured)
    settings = {k: v for k, v in settings_of(args).items() if k not in in_process and k != "home"}
    settings["api_key"] = "***" if api_key else None
    settings["endpoint"] = redact_url(args.endpoint)
    record = {"bench": work.bench, "mode": "http", "endpoint": settings["endpoint"], "served_model": served,
              "machine": machine_info(), "machine_is": "the client (the server may run elsewhere)",
              "model": {"name": served, **model, "served_name": served}, "settings": settings, "results": [summary],
              "requests": {label: request_rows(measured)}}
    report(summary, record)
    write_json(args.json, record)
    if not summary["succeeded"]:
        first = next(r.result for r in measured if not r.result.ok)
        raise ValueError(f"all {summary['failed']} measured requests failed, the first with "
                         f"{_status(first.status)}: {first.error}")
    plot(args.plot, measured, record, work.setup)
    return 0


async def _serve(args: argparse.Namespace, work: HttpWorkload, sessions: Sessions, warmup: list[Turn],
                 turns: list[Turn], api_key: str | None) -> tuple[str, list[HttpRecord], list[HttpRecord]]:
    from kvlayer.benchmarks.http_client import first_model, make_client
    from kvlayer.benchmarks.http_driver import run_phase

    async with make_client(args.endpoint, api_key, args.timeout, work.users) as client:
        served = await first_model(client, args.served_model_name)
        print(f"{work.bench} over HTTP: {served} at {redact_url(args.endpoint)}; {work.setup}")
        print(f"measured: {len(turns)} requests after {len(warmup)} warm-up requests")
        with progress(len(warmup) + len(turns), work.bench) as advance:
            warm = await run_phase(client, served, warmup, sessions, work.answer_tokens, advance)
            measured = await run_phase(client, served, turns, sessions, work.answer_tokens, advance)
    return served, warm, measured


def _status(status: int | None) -> str:
    return "no response" if status is None else f"HTTP {status}"


def report(r: dict[str, Any], record: dict[str, Any]) -> None:
    """Print the table (one row: this run), its failures, and notes on stand-in answers and
    missing cached-token counts."""
    extra = r.get("workload") or {}
    cols = ["label", "requests", "failed", "TTFT mean s", "p50", "p90", "p99", "ITL mean s", "ITL p50", "ITL p90",
            "ITL p99", "req/s", "gen tok/s", "prompt tok/s", "cached", *extra]
    t, i = r["ttft_s"], r["itl_s"]
    row = [r["label"], r["requests"], r["failed"], t["mean"], t["p50"], t["p90"], t["p99"], i["mean"], i["p50"],
           i["p90"], i["p99"], r["request_per_s"], r["generated_tok_per_s"], r["prompt_tok_per_s"],
           r["cached_share"], *extra.values()]
    print_table(f"{record['bench']} over HTTP: {record['served_model']} at {record['endpoint']}", cols, [row])
    for f in r["failures"]:
        print(f"failed: {f['count']} x {_status(f['status'])}: {f['error']}")
    if r["stand_in_answers"]:
        print(f"note: {r['stand_in_answers']} answers came without token_ids (return_token_ids unsupported?): "
              "the prompt's first tokens stood in for them in the users' histories")
    if r["succeeded"] and not r["cached_reported"]:
        print("note: the server reported no cached tokens (usage.prompt_tokens_details.cached_tokens; "
              "vLLM sends them with --enable-prompt-tokens-details)")


def plot(path: str | None, records: list[HttpRecord], record: dict[str, Any], setup: str) -> None:
    """TTFT per request over submission time, the inter-token latencies, and the cached share
    of each request's prompt."""
    if not path:
        return
    ok = [r for r in records if r.result.ok]
    label = record["results"][0]["label"]
    fig, axes = new_figure(1, 3, (15, 4.5))
    ax_t, ax_i, ax_c = axes[0]
    ax_t.plot([r.submit_s for r in ok], [r.result.ttft for r in ok], marker=".", linestyle="", label=label)
    ax_t.set(xlabel="submitted at (wall clock) s", ylabel="TTFT s", yscale="log", title="TTFT per request")
    ax_t.legend(fontsize=8)
    gaps = [1000 * g for r in ok for g in r.result.inter_token_latencies]
    ax_i.hist(gaps or [0.0], bins=40)
    ax_i.set(xlabel="ms", ylabel="gaps", title="inter-token latency")
    cached = [r for r in ok if r.result.cached_tokens is not None and r.result.prompt_tokens]
    ax_c.plot([r.submit_s for r in cached], [r.result.cached_tokens / r.result.prompt_tokens for r in cached],
              marker=".", linestyle="")
    ax_c.set(xlabel="submitted at s", ylabel="cached / prompt tokens", ylim=(0, 1.05),
             title="cached share per request" + ("" if cached else " (none reported)"))
    fig.suptitle(f"{record['bench']} over HTTP: {label}")
    save_figure(fig, path, record, setup)
    close_figure(fig)
