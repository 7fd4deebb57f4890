"""``kvlayer controller`` (run the server) and ``kvlayer admin ...`` (talk to it).

``add_commands(subparsers)`` adds both to the ``kvlayer`` parser; grpc is imported only when a
command runs, so ``kvlayer --help`` stays fast. Examples::

    kvlayer controller --listen 127.0.0.1:50051 --admin-token-file admin.token
    kvlayer admin --token-file admin.token instances
    kvlayer admin lookup --model llama --tokens 1,2,3,4
    kvlayer admin pin --instance engine-0 --tokens-file prompt.json --tier cpu
    kvlayer admin evict --all --tier nvme
    kvlayer admin pins --instance engine-0
    kvlayer admin move --instance engine-0 --to engine-1 --dst-tier cpu --tokens 1,2,3
    kvlayer admin --json stats

Admin commands print tables (``--json`` prints the answer as JSON) and exit 1 with a one-line
error on stderr when the controller refuses or a result reports a failed instance (the answer
is printed first then), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``controller`` and ``admin`` to the ``kvlayer`` subcommands."""
    _add_controller(sub)
    _add_admin(sub)


# --- kvlayer controller ------------------------------------------------------------------
def _add_controller(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("controller", help="run the cache controller (gRPC)")
    c.add_argument("--listen", type=_listen, default=DEFAULT_ADDRESS,
                   help="HOST:PORT to bind, port 0..65535 (default: %(default)s)")
    c.add_argument("--admin-token-file", help="admin bearer token (default: $KVLAYER_ADMIN_TOKEN, else none)")
    c.add_argument("--instance-token-file",
                   help="token instances must send (default: $KVLAYER_CONTROLLER_TOKEN, else none)")
    c.add_argument("--tls-cert", help="PEM certificate (TLS with --tls-key)")
    c.add_argument("--tls-key", help="PEM private key")
    c.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    c.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds between instance heartbeats")
    c.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before an instance "
                   "is marked down")
    c.add_argument("--command-timeout", type=float, default=30.0, help="seconds to wait for an instance's reply")
    c.add_argument("--max-tokens", type=int, default=131_072, help="most tokens in one request")
    c.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024, help="largest message accepted")
    c.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=PATH",
                   help="tokenizer.json (or model folder) for text requests about MODEL; repeatable")
    c.set_defaults(func=_run_controller)


def _listen(text: str) -> str:
    """``--listen``'s ``type=``: a HOST:PORT that ``ControllerSettings`` accepts (the text is kept)."""
    from kvlayer.controller.settings import parse_listen

    try:
        parse_listen(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _run_controller(args: argparse.Namespace) -> int:
    import logging

    from kvlayer.controller.auth import ADMIN_TOKEN_ENV, INSTANCE_TOKEN_ENV, read_token
    from kvlayer.controller.server import serve
    from kvlayer.controller.settings import ControllerSettings, parse_listen

    tokenizers = []
    for item in args.tokenizer:
        model, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--tokenizer takes MODEL=PATH, got {item!r}")
        tokenizers.append((model, path))
    settings = ControllerSettings(
        listen=args.listen, admin_token=read_token(args.admin_token_file, ADMIN_TOKEN_ENV),
        instance_token=read_token(args.instance_token_file, INSTANCE_TOKEN_ENV), tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout, command_timeout_s=args.command_timeout,
        max_tokens=args.max_tokens, max_message_bytes=args.max_message_bytes, tokenizers=tuple(tokenizers))
    logging.getLogger("kvlayer.controller").setLevel(logging.INFO)
    host, _ = parse_listen(args.listen)
    if settings.admin_token is None and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning("the admin API on %s has no token: anyone who reaches it can "
                                            "steer the cache (set --admin-token-file)", args.listen)

    def ready(port: int) -> None:
        """Tell whoever started the controller (a test, a supervisor) where it listens."""
        print(f"kvlayer controller listening on {host}:{port}", flush=True)

    try:
        return serve(settings, ready)
    except OSError as e:  # cannot bind, or a TLS file is unreadable
        print(f"kvlayer controller: {e}", file=sys.stderr)
        return 1


# --- kvlayer admin -----------------------------------------------------------------------
def _add_admin(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("admin", help="inspect and steer the fleet's cache through the controller")
    a.add_argument("--controller", default=os.environ.get("KVLAYER_CONTROLLER_URL") or DEFAULT_ADDRESS,
                   help="HOST:PORT, grpc://... or grpcs://...?ca=FILE (default: $KVLAYER_CONTROLLER_URL "
                        "or %(default)s)")
    a.add_argument("--token-file", help="admin bearer token (default: $KVLAYER_ADMIN_TOKEN)")
    a.add_argument("--tls-ca", help="CA certificate of the controller (implies TLS)")
    a.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    a.add_argument("--json", action="store_true", help="print the answer as JSON")
    cmds = a.add_subparsers(dest="admin_command", required=True)
    _command(cmds, "instances", "list the instances").set_defaults(admin=_instances)
    st = _command(cmds, "stats", "per instance and tier: chunks, bytes, hit rates, health")
    st.add_argument("--instance", default="", help="one instance (default: all)")
    st.set_defaults(admin=_stats)

    lk = _command(cmds, "lookup", "which instance caches how much of a prompt (best first)")
    _prefix_args(lk, model_required=True)
    lk.add_argument("--limit", type=int, default=0, help="at most this many instances")
    lk.set_defaults(admin=_lookup)

    for name, help_ in (("pin", "pin a prefix so it is never evicted"), ("unpin", "undo a pin")):
        p = _command(cmds, name, help_)
        p.add_argument("--instance", required=True)
        p.add_argument("--tier", default="", help="one tier (default: every tier)")
        _prefix_args(p)
        p.set_defaults(admin=_pin, unpin=name == "unpin")

    ev = _command(cmds, "evict", "evict a prefix, or everything")
    ev.add_argument("--instance", default="", help="one instance (default: all)")
    ev.add_argument("--tier", default="", help="one tier (default: every tier)")
    ev.add_argument("--all", action="store_true", help="everything, not a prefix")
    _prefix_args(ev, prefix_required=False)
    ev.set_defaults(admin=_evict)

    mv = _command(cmds, "move", "move a prefix between tiers, or to another instance via a shared tier")
    mv.add_argument("--instance", required=True, help="the source instance")
    mv.add_argument("--src-tier", default="", help="source tier (required within one instance)")
    mv.add_argument("--dst-tier", required=True)
    mv.add_argument("--to", default="", help="destination instance (default: the source)")
    mv.add_argument("--via", default="", help="shared tier to go through (default: the only one)")
    mv.add_argument("--keep-source", action="store_true", help="copy instead of move")
    _prefix_args(mv)
    mv.set_defaults(admin=_move)

    ps = _command(cmds, "pins", "list pinned chunks and their pin counts, per instance and tier")
    ps.add_argument("--instance", default="", help="one instance (default: every live one)")
    ps.add_argument("--tier", default="", help="one tier (default: every tier)")
    _prefix_args(ps, prefix_required=False)
    ps.set_defaults(admin=_pins)
    a.set_defaults(func=_run_admin)


def _command(cmds: argparse._SubParsersAction, name: str, help_: str) -> argparse.ArgumentParser:
    """An admin subcommand; it takes ``--json`` after its name too."""
    p = cmds.add_parser(name, help=help_)
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the answer as JSON")
    return p


def _prefix_args(p: argparse.ArgumentParser, model_required: bool = False, prefix_required: bool = True) -> None:
    group = p.add_mutually_exclusive_group(required=prefix_required)
    group.add_argument("--tokens", help="token ids, separated by commas or spaces")
    group.add_argument("--tokens-file", help="a JSON list of token ids, or ids separated by whitespace")
    group.add_argument("--text", help="text (the controller needs the model's tokenizer)")
    p.add_argument("--model", required=model_required, default="", help="the model the prompt is for")
    p.add_argument("--salt", default=None, help="the tenant's cache salt (default: the instance's)")


def _token_ids(args: argparse.Namespace) -> list[int] | None:
    raw = args.tokens
    if args.tokens_file:
        raw = Path(args.tokens_file).read_text()
        if raw.lstrip().startswith("["):
            return [int(t) for t in json.loads(raw)]
    if raw is None:
        return None
    try:
        return [int(t) for t in raw.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"token ids must be integers, got {raw[:60]!r}") from None


def _prefix_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"text": args.text, "model": args.model, "cache_salt": args.salt}


def _run_admin(args: argparse.Namespace) -> int:
    from kvlayer.controller import render
    from kvlayer.controller.auth import ADMIN_TOKEN_ENV, read_token
    from kvlayer.controller.client import AdminClient, ControllerError

    token = read_token(args.token_file, ADMIN_TOKEN_ENV)
    with AdminClient(args.controller, token, tls_ca=args.tls_ca, timeout=args.timeout) as client:
        try:
            answer = args.admin(client, args)
        except ControllerError as e:
            print(f"kvlayer admin: {e.code}: {e.message}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(render.to_dict(answer), indent=2))
    else:
        render.print_answer(answer)
    failed = render.failures(answer)
    if failed is not None:
        print(f"kvlayer admin: {failed}", file=sys.stderr)
        return 1
    return 0


def _instances(client: Any, args: argparse.Namespace) -> Any:
    return client.list_instances()


def _stats(client: Any, args: argparse.Namespace) -> Any:
    return client.stats(args.instance)


def _lookup(client: Any, args: argparse.Namespace) -> Any:
    return client.lookup(_token_ids(args), args.model, text=args.text, cache_salt=args.salt, limit=args.limit)


def _pin(client: Any, args: argparse.Namespace) -> Any:
    call = client.unpin if args.unpin else client.pin
    return call(args.instance, _token_ids(args), tier=args.tier, **_prefix_kwargs(args))


def _evict(client: Any, args: argparse.Namespace) -> Any:
    return client.evict(args.instance, _token_ids(args), all=args.all, tier=args.tier, **_prefix_kwargs(args))


def _pins(client: Any, args: argparse.Namespace) -> Any:
    return client.pins(args.instance, _token_ids(args), tier=args.tier, **_prefix_kwargs(args))


def _move(client: Any, args: argparse.Namespace) -> Any:
    return client.move(args.instance, _token_ids(args), dst_tier=args.dst_tier, src_tier=args.src_tier,
                       dst_instance_id=args.to, via_tier=args.via, keep_source=args.keep_source,
                       **_prefix_kwargs(args))
