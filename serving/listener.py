"""The process side ``kvlayer serve`` and ``kvlayer router`` share: the port, API-key files, uvicorn.

``read_api_keys`` reads a key file; ``bind_socket`` binds the port before anything slow
starts, so a port in use is a one-line error at once; ``base_url`` names the bound address;
``run_server`` serves an ASGI app on the socket until SIGTERM or SIGINT drain it. This module
imports the standard library only (uvicorn when ``run_server`` runs), so both commands'
``add_command`` and ``kvlayer --help`` stay light, and the router needs neither the engine nor
torch.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any


def read_api_keys(path: str) -> list[str]:
    """The keys in ``path``: one per line, blank lines and ``#`` comments skipped; ValueError
    when there is none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in the file")
    return keys


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ValueError (one line) when the address is taken or invalid."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


def base_url(host: str, port: int) -> str:
    """The URL clients and the controller reach this server at (the host's name when bound to all addresses)."""
    name = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"


def run_server(app: Any, sock: socket.socket, name: str) -> bool:
    """Serve ``app`` on ``sock`` with uvicorn until SIGTERM or SIGINT, which drain it (running
    requests finish, then the app's shutdown runs); returns whether it started."""
    import uvicorn

    config = uvicorn.Config(app, log_level=logging.getLevelName(logging.getLogger().level).lower(),
                            access_log=False, timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained, with the handler it
    # found installed: a drained server then exits 0, not by the signal's default action.
    stopped_by: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: stopped_by.append(number))
    server.run(sockets=[sock])
    if stopped_by:
        print(f"{name}: drained and stopped ({signal.Signals(stopped_by[0]).name})", file=sys.stderr)
    return bool(server.started)
