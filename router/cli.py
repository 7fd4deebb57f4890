"""``kvlayer router``: an OpenAI-compatible proxy in front of a fleet (docs/fleet.md).

``add_command(subparsers)`` adds it to the ``kvlayer`` parser; FastAPI, uvicorn, httpx and
grpc are imported only when it runs; torch and the engine never are, except the engine's
tokenizer (and with it torch) for ``--tokenizer``. The port is bound first, so a port in use is
a one-line error at once. SIGTERM or SIGINT stop taking connections, let open requests finish
and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvlayer.flags import nonnegative_float, port_number, positive_float
from kvlayer.serving.listener import base_url, bind_socket, read_api_keys, run_server


def add_command(sub: argparse._SubParsersAction) -> None:
    from kvlayer.router import DEFAULT_LOAD_COST, POLICIES

    r = sub.add_parser("router", help="route OpenAI requests to the instance that holds their prefix")
    r.add_argument("--controller", required=True, help="the controller's address (HOST:PORT, grpc://, grpcs://...)")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    r.add_argument("--port", type=port_number, default=8080, help="port to bind (default: %(default)s)")
    r.add_argument("--policy", choices=POLICIES, default="kv", help="how to choose an instance (default: %(default)s)")
    r.add_argument("--load-cost", type=nonnegative_float, default=float(DEFAULT_LOAD_COST),
                   help="kv policy: cached prompt tokens one running or waiting request is worth "
                        "(default: %(default)g)")
    r.add_argument("--lookup-timeout-ms", type=positive_float, default=100.0,
                   help="deadline of the controller's prefix lookup; past it, route by load (default: %(default)g)")
    r.add_argument("--refresh-ms", type=positive_float, default=500.0,
                   help="how often the instance list and loads are refreshed (default: %(default)g)")
    r.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation: prompts to 'prefill' instances, then decode on 'decode' ones")
    r.add_argument("--controller-token-file", help="the controller's admin token (default: $KVLAYER_ADMIN_TOKEN)")
    r.add_argument("--api-key-file", help="keys clients must send (one per line); /v1/* then needs them")
    r.add_argument("--instance-api-key-file", help="the key to send to instances (its first line)")
    r.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=DIR",
                   help="a model folder whose tokenizer and chat template the router uses to look up text and "
                        "chat prompts of MODEL (repeatable; without one, text goes to the controller to tokenize "
                        "and chat is routed by load)")
    r.set_defaults(func=run)


def _tokenizers(specs: list[str]) -> dict[str, Any]:
    from kvlayer.engine.tokenizer import Tokenizer
    from kvlayer.serving.chat import ChatTemplate

    out = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--tokenizer must be MODEL=DIR, got {spec!r}")
        tok = Tokenizer.from_dir(folder)
        if tok is None:
            raise ValueError(f"--tokenizer {spec}: no tokenizer.json in {folder}")
        out[name] = (tok, ChatTemplate.from_dir(folder))
    return out


def run(args: argparse.Namespace) -> int:
    from kvlayer.controller.auth import read_token
    from kvlayer.controller.channel import parse_target
    from kvlayer.router.app import RouterSettings, build_router_app

    parse_target(args.controller)  # ValueError (one line) for a malformed address
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))  # no line per probe
    settings = RouterSettings(
        controller=args.controller, policy=args.policy,
        controller_token=read_token(args.controller_token_file, "KVLAYER_ADMIN_TOKEN"),
        api_keys=read_api_keys(args.api_key_file) if args.api_key_file else (),
        instance_api_key=read_api_keys(args.instance_api_key_file)[0] if args.instance_api_key_file else None,
        pd=args.pd, load_cost=args.load_cost, lookup_timeout_s=args.lookup_timeout_ms / 1000,
        refresh_s=args.refresh_ms / 1000, tokenizers=_tokenizers(args.tokenizer))
    sock = bind_socket(args.host, args.port)
    try:
        app = build_router_app(settings)
        url = base_url(args.host, sock.getsockname()[1])
        print(f"kvlayer router: {url}, policy {args.policy}{' with P/D' if args.pd else ''}, controller "
              f"{args.controller}", file=sys.stderr, flush=True)
        return 0 if run_server(app, sock, "kvlayer router") else 1
    finally:
        sock.close()
