"""``kvlayer cache-server``: run the node cache server, or print a running one's ``--stats``.

``kvlayer cache-server --socket PATH --cpu-capacity SIZE [--config FILE]``. The config file (and
``KVLAYER_*`` variables) may give the socket (``cache_server``), the token
(``cache_server_token``), the capacity (``cpu_capacity``), the per-tenant quota
(``cache_salt_quota``), the socket's group (``cache_socket_group``), the metrics port
(``cache_metrics_port``) and the controller (``controller_url``, ``controller_token``: the server
registers its tiers there, ``kvlayer.cacheserver.controller_link``); the flags win. The server
prints one line once it listens and stops on SIGTERM or SIGINT, removing its socket and arena file.
This module imports only argparse at import time, so ``kvlayer --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvlayer.config import KVLayerConfig


def add_command(sub: argparse._SubParsersAction) -> None:
    """Register ``cache-server`` on the ``kvlayer`` command line."""
    s = sub.add_parser("cache-server", help="one machine's CPU cache in shared memory, shared by its engine processes")
    s.add_argument("--socket", help="Unix socket to listen on (default: the config's cache_server)")
    s.add_argument("--cpu-capacity", help="bytes of the shared arena, e.g. 8GiB (default: the config's cpu_capacity)")
    s.add_argument("--config", help="kvlayer YAML config (cache_server, cache_server_token, cpu_capacity, "
                                    "cache_salt_quota, cache_socket_group, cache_metrics_port)")
    s.add_argument("--salt-quota", help="the most one tenant (cache_salt) holds: a size (2GiB) or a fraction "
                                        "of the arena (0.25); default: no quota")
    s.add_argument("--socket-group", help="group given the socket and the arena file, which become mode 0660")
    s.add_argument("--token-file", help="file whose first line is the token clients must present "
                                        "(default: the config's cache_server_token)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default 127.0.0.1)")
    s.add_argument("--scrub-mib-s", type=float, default=512.0,
                   help="MiB/s of re-verifying sealed chunks against their checksums (default 512; 0: off, "
                        "commits are still verified)")
    s.add_argument("--controller-url", help="register the server's tiers with this kvlayer controller "
                                            "(default: the config's controller_url)")
    s.add_argument("--controller-token-file", help="file whose first line is the controller's bearer token "
                                                   "(default: the config's controller_token)")
    s.add_argument("--stats", action="store_true", help="print the running server's accounting and exit")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal (or print ``--stats``); ``ValueError`` (one line, exit 2) for a bad setting."""
    import asyncio

    from kvlayer.config import KVLayerConfig
    from kvlayer.sizes import format_size, parse_size

    config = KVLayerConfig.load(args.config)
    path = args.socket or config.cache_server
    if not path:
        raise ValueError("cache-server needs --socket PATH (or cache_server in the config)")
    token = _read_token(args.token_file) if args.token_file else config.cache_server_token
    if args.stats:
        return _print_stats(path, token)
    capacity = parse_size(args.cpu_capacity) if args.cpu_capacity is not None else _capacity(config)
    from kvlayer.cacheserver.server import CacheServer
    from kvlayer.cacheserver.settings import quota_bytes

    quota = args.salt_quota or config.cache_salt_quota
    port = args.metrics_port if args.metrics_port is not None else config.cache_metrics_port
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be in 0..65535 (0: off), got {port}")
    lower = None  # the config's nvme_path / redis_url: the server's own tiers (torch is imported only then)
    if any(s.enabled for name, s in config.tiers.items() if name in ("nvme", "redis")):
        from kvlayer.cacheserver.lower import LowerTiers

        lower = LowerTiers.from_config(config)
    server = CacheServer(path, capacity, token, salt_quota=quota_bytes(quota, capacity) if quota else None,
                         socket_group=args.socket_group or config.cache_socket_group,
                         metrics=(args.metrics_host, port) if port else None, lower=lower,
                         scrub_rate=int(args.scrub_mib_s * 2**20))
    url = args.controller_url or config.controller_url
    controller_token = (_read_token(args.controller_token_file) if args.controller_token_file
                        else config.controller_token)
    try:
        asyncio.run(_serve(server, f"kvlayer cache-server: listening on {path} ({format_size(capacity)} "
                                   f"arena {server.arena.path}, epoch {server.arena.epoch:016x})",
                           (config, url, controller_token) if url else None))
    except BaseException:
        server.close()
        raise
    return 0


def _read_token(path: str) -> str:
    """The first line of ``path``; ``ValueError`` for an empty one (``OSError`` if unreadable)."""
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if not token:
        raise ValueError(f"--token-file {path}: empty")
    return token


def _capacity(config: KVLayerConfig) -> int:
    """The arena's size from a config: its ``cpu_capacity``, or the CPU tier's default where the
    config's ``cache_server`` turned it to 0 (the ``cache`` tier stands in for a client's CPU tier)."""
    from kvlayer.tier_settings import installed

    size = config.cpu_capacity
    if size == 0 and config.cache_server:
        size = next(s.default for s in installed()["cpu"].settings if s.key == "capacity")
    return int(size)


async def _serve(server: object, banner: str, controller: tuple[KVLayerConfig, str, str | None] | None) -> None:
    import asyncio
    import signal

    stop, closing = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()  # type: ignore[attr-defined]
    link = None
    if controller is not None:  # grpc is imported only then
        from kvlayer.cacheserver.controller_link import start_link

        link = start_link(server, *controller)  # type: ignore[arg-type]
    print(banner, flush=True)
    serving = asyncio.ensure_future(server.serve_until(closing))  # type: ignore[attr-defined]
    try:
        await stop.wait()
        if link is not None:  # its streams end before the tiers they report close
            await link.close()
    finally:
        closing.set()
        await serving


def _print_stats(path: str, token: str | None) -> int:
    from kvlayer.cacheserver import protocol as wire
    from kvlayer.cacheserver.sync_client import SyncClient

    try:
        with SyncClient(path, token) as client:
            stats = client.stats()
            quota, tenants = wire.parse_tenants(client.call(wire.Op.TENANTS))
    except OSError as e:
        print(f"kvlayer: error: cache server at {path}: {e}", file=sys.stderr)
        return 2
    for name, value in stats._asdict().items():
        print(f"{name}: {value:016x}" if name == "epoch" else f"{name}: {value}")
    print(f"salt_quota_bytes: {quota}")
    for t in tenants:
        print(f"tenant {t.tenant.hex()}: used_bytes {t.used_bytes}, chunks {t.chunks}, refused {t.refused}")
    return 0
