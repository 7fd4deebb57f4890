"""``kvlayer serve``: the bundled engine behind an OpenAI-compatible HTTP server (docs/serving.md).

``add_command(subparsers)`` adds the command to the ``kvlayer`` parser; FastAPI, uvicorn and
the engine are imported only when it runs. The port is bound before the model loads, so a
port in use is a one-line error at once. kvlayer's config comes from ``--kv-config`` and the
``KVLAYER_*`` variables (``--no-kvlayer``: the engine alone); with ``controller_url`` and no
``instance_address`` the server registers its own base URL (``http://HOST:PORT``) as the
instance's address, for routing; the name it serves the model under (``--served-model-name``,
else ``--model`` as given) is kvlayer's ``served_model_name``, which the controller registers.

Before the model loads, kvlayer's memory sizes are checked against the machine (one line, exit
2: ``kvlayer.capacity``) and each tier's place is tried (``kvlayer.places``): a tier whose
``nvme_path`` or ``redis_url`` is unusable is left out, and the start-up line names it beside
the tiers in effect and their capacities. SIGTERM or SIGINT stop taking connections, let running
requests finish, flush kvlayer's writes and exit 0 (serving/listener.py, shared with the router).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvlayer.flags import port_number, positive_int
from kvlayer.serving.listener import base_url, bind_socket, read_api_keys, run_server

if TYPE_CHECKING:
    from kvlayer.config import KVLayerConfig
    from kvlayer.places import Unusable


def add_command(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the bundled engine, with kvlayer")
    s.add_argument("--model", required=True, help="model folder (config.json + safetensors [+ tokenizer.json])")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    s.add_argument("--port", type=port_number, default=8000,
                   help="port to bind, 0 for any free one (default: %(default)s)")
    s.add_argument("--kv-config", help="kvlayer YAML config (default: kvlayer's defaults; KVLAYER_* variables apply)")
    s.add_argument("--no-kvlayer", action="store_true", help="serve the engine alone (its own prefix cache only)")
    s.add_argument("--served-model-name", help="the model name clients send (default: --model as given)")
    s.add_argument("--api-key-file", help="file of accepted API keys, one per line; /v1/* then needs "
                                          "'Authorization: Bearer KEY'")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    s.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on the CPU, "
                                                 "bfloat16 on CUDA)")
    s.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: %(default)s)")
    s.add_argument("--kv-cache-memory", default=None, help="the engine's KV cache size, e.g. 2GiB (default: 1GiB)")
    s.add_argument("--max-num-seqs", type=positive_int, default=64, help="most requests running at once")
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=4096, help="most tokens in one step")
    s.add_argument("--max-model-len", type=positive_int, default=None, help="context length (default: the model's)")
    s.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's own prefix cache off")
    s.add_argument("--role", choices=("both", "prefill", "decode"),
                   help="this instance's part in prefill/decode disaggregation, registered with the controller "
                        "(sets kvlayer's instance_role; default: the config's, 'both')")
    s.add_argument("--torch-threads", type=positive_int, help="torch's CPU threads (default: torch's choice)")
    s.add_argument("--max-waiting", type=positive_int, default=256,
                   help="queued requests past which new ones get 503 (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=positive_int, default=16 * 1024**2,
                   help="largest request body accepted; larger ones get 413 (default: %(default)s)")
    s.set_defaults(func=run)


def _kv_config(args: argparse.Namespace, url: str) -> tuple[KVLayerConfig | None, list[Unusable]]:
    """kvlayer's config for this server (None: ``--no-kvlayer``) and the tiers left out because
    their place is unusable. ``ConfigError`` (one line) when its memory sizes do not fit."""
    if args.no_kvlayer:
        return None, []
    from kvlayer import capacity, places
    from kvlayer.config import KVLayerConfig

    config = KVLayerConfig.load(args.kv_config)
    changes: dict[str, Any] = {"served_model_name": _served_name(args)}
    if args.role is not None:
        changes["instance_role"] = args.role
    if config.controller_url and not config.instance_address:
        changes["instance_address"] = url
    config = config.replace(**changes)
    capacity.check_memory(config, args.device)  # before a model or an arena is allocated
    skipped = places.unusable(config)
    config = places.without(config, skipped)
    return config, skipped


def _served_name(args: argparse.Namespace) -> str:
    """The model name clients send: ``--served-model-name``, else ``--model`` as given."""
    return args.served_model_name or args.model


def _startup_line(name: str, url: str, kv: Any, skipped: Sequence[Unusable]) -> str:
    """``kvlayer serve: 'NAME' at URL (kvlayer on: tiers ...)``, or ``(kvlayer off)``."""
    if kv is None:
        return f"kvlayer serve: {name!r} at {url} (kvlayer off)"
    from kvlayer.places import tiers_line

    return f"kvlayer serve: {name!r} at {url} (kvlayer on: {tiers_line(kv.backends, kv.config, skipped)})"


def run(args: argparse.Namespace) -> int:
    keys = read_api_keys(args.api_key_file) if args.api_key_file else []
    sock = bind_socket(args.host, args.port)
    try:
        return _serve(args, sock, keys)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket, keys: list[str]) -> int:
    from kvlayer.engine.llm import LLM
    from kvlayer.serving.app import build_app
    from kvlayer.serving.chat import ChatTemplate
    from kvlayer.serving.completions import ServerState
    from kvlayer.serving.engine_loop import AsyncEngine
    from kvlayer.serving.metrics import ServingMetrics

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    port = sock.getsockname()[1]
    url = base_url(args.host, port)
    kv_config, skipped = _kv_config(args, url)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, kv_config=kv_config)
    engine = llm.engine
    kv = getattr(engine.connector, "kv", None)
    metrics = ServingMetrics(getattr(kv, "metrics", None))
    loop = AsyncEngine(engine, args.max_waiting)
    name = _served_name(args)
    state = ServerState(loop, name, engine.tokenizer, ChatTemplate.from_dir(args.model), metrics,
                        engine.model_config.vocab_size, engine.max_model_len)
    app = build_app(state, keys, args.max_body_bytes)
    print(_startup_line(name, url, kv, skipped), file=sys.stderr, flush=True)
    if not run_server(app, sock, "kvlayer serve"):
        loop.close_unstarted()
        return 1
    return 0
