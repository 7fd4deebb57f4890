"""``kvlayer bench fleet``: chat users through ``kvlayer router`` over several ``kvlayer serve``
instances, on the wall clock: KV-aware routing against round-robin and random, and
prefill/decode disaggregation against colocated serving.

Each configuration gets a fresh fleet (benchmarks/fleet_procs.py): a controller, the instances
(``--torch-threads 1`` each) and a router with the configuration's policy. The workload is
multi-round-qa's (benchmarks/workloads.py), seeded, identical for every configuration: users
share a system prompt, bring a history each, and return every round; every user's first
``--warmup-rounds`` questions are served before measuring. Each instance has a small engine KV
cache (``--engine-kv-memory``, default two of the largest requests), so the engine's own prefix
cache cannot keep the users' histories, and a kvlayer CPU tier of its own with no shared tier
(``--cpu-capacity``, default 1.25 x the KV of its share of the users if each user stays on one
instance: the fleet's CPU tiers hold every history only when no history is kept twice). A
history therefore hits only on an instance that served the user before and still holds it.

The P/D pair (``--pd``, the default): one ``--role prefill`` and one ``--role decode`` instance
behind ``router --pd``, against two ``role both`` instances under ``kv``. Both pairs share one
Redis (``--redis-url``, else a ``redis-server`` of their own on a free port, fresh per
configuration), since P/D needs it to move KV and the comparison should differ in the roles
alone, not in the tiers; each configuration also writes under its own key prefix. Without
``redis-server`` or ``kvlayer serve --role`` the pair is skipped with the reason printed.

Reported per configuration: requests, failures, the cached share of prompt tokens
(``usage.prompt_tokens_details.cached_tokens``; under P/D it counts the KV the decode instance
loaded from Redis, so it is no hit rate there), TTFT mean/p90, ITL mean, generated tokens/s,
and per instance the requests it answered (``x-kvlayer-instance``), its mean load (the router's
``kvlayer_router_instance_load``, sampled) and the prompt tokens it computed; then mean TTFT
and tokens/s of ``kv`` over ``round-robin`` against the goal (TTFT <= 0.5x, tokens/s >= 1.5x),
and of P/D over colocated.

The router's prefix-lookup deadline is 1 s here (its default, 100 ms, assumes a controller
with cores of its own); a lookup past it routes by load, and the record counts them.

Past one machine: here the instances (one core's worth of compute each), the router, the
controller and the client share 2 cores. On machines of their own, absolute times shrink with
the hardware, but the hit rate each policy gets stays a matter of where histories are cached and
how much each tier holds, not of compute: round-robin and random send a returning user
elsewhere about (N-1)/N of the time, so their hit rate falls as instances are added while kv's
does not, and only under kv do the instances' CPU tiers add up (each history kept once). At low
load the TTFT ratio is about hit TTFT / miss TTFT; the tokens/s ratio exceeds 1 only while the
baseline fleet is saturated at the offered rate (a fleet with spare capacity serves the same
tokens/s under any policy), so it shrinks as machines are added at a fixed rate. Across a
network the lookup costs a round trip per request, and P/D moves each prompt's KV through Redis
over the wire instead of loopback.

Example: ``kvlayer bench fleet --instances 2 --policies kv,round-robin,random --json fleet.json --plot fleet.png``
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlayer.benchmarks.common import (
    add_plot_argument,
    checked_text,
    default_model,
    machine_info,
    model_facts,
    nonnegative_int,
    positive_float,
    positive_int,
    progress,
    settings_of,
    size_or_auto,
    write_json,
)
from kvlayer.benchmarks.workloads import ChatSessions, MultiRoundSpec, Turn
from kvlayer.router import POLICIES
from kvlayer.sizes import parse_size

CPU_HEADROOM = 1.25
TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration measured: ``roles`` of its instances, the router's ``policy`` and
    ``pd``, and whether its instances share a Redis tier."""

    name: str
    roles: tuple[str, ...]
    policy: str
    pd: bool = False
    shared: bool = False


@dataclass(frozen=True, slots=True)
class Workload:
    """The users (``spec``, token ids below ``vocab``) and their (warm-up, measured) turns."""

    spec: MultiRoundSpec
    vocab: int
    warmup: list[Turn]
    turns: list[Turn]


def instance_count(text: str) -> int:
    """An integer within 2..8 (two instances at least to route between; more do not fit a small machine)."""
    n = positive_int(text)
    if not 2 <= n <= 8:
        raise argparse.ArgumentTypeError(f"must be within 2..8, got {n}")
    return n


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",")]
    if "" in names:
        raise ValueError(f"empty item in {text!r}")
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a policy named twice in {text!r}")
    return names


policy_list = checked_text(_policies)
"""Comma-separated routing policies of ``kvlayer router``, each once; the text is kept."""


def _redis_url(text: str) -> None:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"expected a URL starting redis://, rediss:// or unix://, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=instance_count, default=2, help="instances per policy run (2..8)")
    p.add_argument("--policies", type=policy_list, default="kv,round-robin,random",
                   help=f"router policies to compare, comma-separated ({', '.join(POLICIES)})")
    p.add_argument("--pd", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare 1 prefill + 1 decode instance (router --pd) against 2 colocated ones")
    p.add_argument("--users", type=positive_int, default=5)
    p.add_argument("--rounds", type=positive_int, default=4, help="questions per user, warm-up rounds included")
    p.add_argument("--warmup-rounds", type=nonnegative_int, default=1,
                   help="first questions of every user served before measuring; fewer than --rounds")
    p.add_argument("--system-tokens", type=nonnegative_int, default=256, help="shared system prompt")
    p.add_argument("--history-tokens", type=nonnegative_int, default=1536, help="each user's own history")
    p.add_argument("--question-tokens", type=positive_int, default=32)
    p.add_argument("--answer-tokens", type=positive_int, default=16)
    p.add_argument("--rate", type=positive_float, default=1.0, help="request arrivals per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-kv-memory", type=size_or_auto, default="auto",
                   help="each engine's own KV cache (auto: two of the largest requests)")
    p.add_argument("--cpu-capacity", type=size_or_auto, default="auto",
                   help="each instance's kvlayer CPU tier (auto: 1.25 x the KV of its share of the users)")
    p.add_argument("--chunk-size", type=positive_int, default=256, help="kvlayer's tokens per chunk")
    p.add_argument("--redis-url", type=checked_text(_redis_url),
                   help="the P/D pair's shared tier (default: a redis-server of its own on a free port)")
    add_plot_argument(p)


def main(args: argparse.Namespace) -> int:
    from kvlayer.benchmarks.fleet_procs import sigterm_exits

    if args.warmup_rounds >= args.rounds:
        raise ValueError(f"--warmup-rounds must be below --rounds ({args.rounds}), got {args.warmup_rounds}")
    spec = MultiRoundSpec(args.users, args.rounds, args.system_tokens, args.history_tokens,
                          args.question_tokens, args.answer_tokens, args.seed)
    model = args.model or default_model(args.home, "bench")
    facts = model_facts(model, args.device)
    sizes = fleet_sizes(spec, facts["kv_bytes_per_token"], args)
    configs = [Config(p, ("both",) * args.instances, p) for p in _policies(args.policies)]
    pd_skipped = pd_unavailable(args) if args.pd else "--no-pd"
    if args.pd and pd_skipped is None:
        configs += [Config("colocated", ("both", "both"), "kv", shared=True),
                    Config("pd", ("prefill", "decode"), "kv", pd=True, shared=True)]
    warmup, turns = spec.turns(args.rate, args.warmup_rounds)
    record = {"bench": "fleet", "machine": machine_info(args.device), "model": facts, "settings": settings_of(args),
              "sizes": sizes, "pd_skipped": pd_skipped,
              "configs": [{"name": c.name, "roles": list(c.roles), "policy": c.policy, "pd": c.pd,
                           "shared_tier": "redis" if c.shared else None} for c in configs]}
    _introduce(record, spec, len(warmup), len(turns))
    work = Workload(spec, facts["vocab"], warmup, turns)
    results, rows = [], {}
    with sigterm_exits(), tempfile.TemporaryDirectory(prefix="kvlayer-fleet-") as folder, \
            progress(len(configs) * (len(warmup) + len(turns)), "fleet") as advance:
        for config in configs:
            summary, rows[config.name] = _measure(config, model, work, sizes, args, Path(folder), advance)
            results.append(summary)
    from kvlayer.benchmarks.fleet_report import check_results, plot, report

    record.update(results=results, requests=rows)
    record["goals"] = report(results, record)
    write_json(args.json, record)
    check_results(results)
    plot(args.plot, results, rows, record)
    return 0


def fleet_sizes(spec: MultiRoundSpec, kv_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """The engine KV cache and CPU tier of each instance, in bytes, with what they hold.
    ValueError for an engine KV cache below the largest request."""
    largest = spec.max_request_tokens()
    engine = 2 * 16 * math.ceil(largest / 16) * kv_bytes if args.engine_kv_memory == "auto" \
        else parse_size(args.engine_kv_memory)
    if engine < largest * kv_bytes:
        raise ValueError(f"--engine-kv-memory {args.engine_kv_memory} cannot hold the largest request "
                         f"({largest:,} tokens = {largest * kv_bytes:,} bytes)")
    per_user = largest - spec.system_tokens
    share = spec.system_tokens + math.ceil(spec.users / args.instances) * per_user
    cpu = math.ceil(CPU_HEADROOM * share * kv_bytes) if args.cpu_capacity == "auto" else parse_size(args.cpu_capacity)
    if cpu < args.chunk_size * kv_bytes:
        raise ValueError(f"--cpu-capacity {args.cpu_capacity} holds no chunk of {args.chunk_size} tokens")
    working_set = spec.working_set_tokens()
    return {"engine_kv_bytes": engine, "engine_kv_tokens": engine // kv_bytes, "cpu_capacity_bytes": cpu,
            "cpu_capacity_tokens": cpu // kv_bytes, "working_set_tokens": working_set,
            "largest_request_tokens": largest,
            "cpu_tier_over_working_set": cpu // kv_bytes / working_set,
            "working_set_over_engine_kv": working_set / (engine // kv_bytes)}


def pd_unavailable(args: argparse.Namespace) -> str | None:
    """Why the P/D pair cannot run here (None: it can)."""
    from kvlayer.benchmarks.redis_local import LocalRedis

    if not args.redis_url and not LocalRedis.available():
        return "redis-server is not on PATH (or give --redis-url)"
    if not serve_has_role():
        return "kvlayer serve has no --role yet"
    return None


def serve_has_role() -> bool:
    """Whether ``kvlayer serve`` takes ``--role prefill``."""
    from kvlayer.serving.cli import add_command

    parser = argparse.ArgumentParser(add_help=False)
    add_command(parser.add_subparsers())
    args, extra = parser.parse_known_args(["serve", "--model", "m", "--role", "prefill"])
    return not extra and getattr(args, "role", None) == "prefill"


def _introduce(record: dict[str, Any], spec: MultiRoundSpec, warm: int, measured: int) -> None:
    m, s, z = record["machine"], record["settings"], record["sizes"]
    print(f"machine: {m['cpu']}, {m['cores']} cores{', ' + m['gpu'] if m['gpu'] else ''}, torch {m['torch']}; "
          f"every process below shares it (instances 1 torch thread each)")
    print(f"fleet: {spec.users} users x {spec.rounds} rounds ({s['warmup_rounds']} warm-up) at {s['rate']:g} req/s, "
          f"system {spec.system_tokens} + history {spec.history_tokens}, questions {spec.question_tokens}, answers "
          f"{spec.answer_tokens}; {warm} warm-up + {measured} measured requests per configuration")
    print(f"per instance: engine KV {z['engine_kv_tokens']:,} tokens, CPU tier {z['cpu_capacity_tokens']:,} tokens "
          f"({z['cpu_tier_over_working_set']:.2f} x the working set of {z['working_set_tokens']:,}), chunk "
          f"{s['chunk_size']}; configurations: {', '.join(c['name'] for c in record['configs'])}")
    if record["pd_skipped"] and s["pd"]:
        print(f"P/D skipped: {record['pd_skipped']}")
    if math.gcd(spec.users, s["instances"]) > 1 and "round-robin" in [c["name"] for c in record["configs"]]:
        print(f"note: {s['instances']} instances and {spec.users} users share a factor: users take turns in a fixed "
              "cycle, so round-robin sends some users to the same instance every round (a best case for it)")


def _measure(config: Config, model: str, work: Workload, sizes: dict[str, Any], args: argparse.Namespace,
             folder: Path, advance: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start ``config``'s fleet (and Redis), serve the workload through it, stop it all."""
    import asyncio

    from kvlayer.benchmarks.fleet_procs import FleetPlan, running_fleet
    from kvlayer.benchmarks.fleet_run import drive, summarize_config
    from kvlayer.benchmarks.http_driver import request_rows
    from kvlayer.benchmarks.redis_local import LocalRedis

    kv: dict[str, object] = {"chunk_size": args.chunk_size, "cpu_capacity": sizes["cpu_capacity_bytes"]}
    with contextlib.ExitStack() as stack:
        if config.shared:
            url = args.redis_url or stack.enter_context(LocalRedis()).url
            kv.update(redis_url=url, redis_key_prefix=f"{folder.name}-{config.name}", redis_ttl_s=3600)
        plan = FleetPlan(model, config.roles, config.policy, config.pd, kv, sizes["engine_kv_bytes"], args.device)
        router = stack.enter_context(running_fleet(plan, folder / config.name))
        sessions = ChatSessions(work.spec, work.vocab)  # every configuration starts from the same histories
        result = asyncio.run(drive(router, plan.served_name, sessions, work.warmup, work.turns,
                                   work.spec.answer_tokens, work.spec.users, TIMEOUT_S, advance))
    summary = summarize_config(config.name, dict(zip(plan.names, config.roles)), result)
    rows = [{**row, "instance": r.result.instance} for row, r in zip(request_rows(result.measured), result.measured)]
    return summary, rows
