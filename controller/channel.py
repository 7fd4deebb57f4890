"""How clients reach the controller: ``Target`` (parsed from a URL) and channels to it.

Accepted forms: ``HOST:PORT`` and ``grpc://HOST:PORT`` (plaintext), ``grpcs://HOST:PORT``
(TLS, system roots), ``grpcs://HOST:PORT?ca=/path/ca.pem`` (TLS with this CA; also
``cert=``/``key=`` for a client certificate, and ``server_name=`` to override the name the
certificate is checked against). The agent (asyncio) and the admin client (blocking) use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""What a client accepts from the controller (the server bounds what it accepts itself)."""

RECONNECT_BACKOFF_MS = (500, 2000)
"""A channel's first and longest wait between attempts to reach a controller that is away.
gRPC's own longest is 120 s and its waits grow with the outage: a client that lived through a
30 s outage measured 11.7 s more of failed calls after the controller was back (with 2 s,
0.2 s). An attempt on a loopback or LAN address costs next to nothing."""


@dataclass(frozen=True, slots=True)
class Target:
    """A controller address and how to secure the channel to it."""

    address: str
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def options(self) -> list[tuple[str, Any]]:
        """Channel options: message size limits, reconnect backoff and the TLS name override."""
        opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                                       ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                                       ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return opts

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the files named (``OSError`` if one is unreadable)."""
        read = lambda p: Path(p).read_bytes() if p else None
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


def parse_target(url: str, tls_ca: str | None = None) -> Target:
    """The target of ``url`` (forms in the module docstring); ``tls_ca`` implies TLS with that CA.

    ``ValueError`` naming the problem for anything else.
    """
    raw = url.strip()
    if "://" not in raw:
        raw = f"grpc://{raw}"
    parts = urlsplit(raw)
    if parts.scheme not in ("grpc", "grpcs"):
        raise ValueError(f"controller URL must be HOST:PORT, grpc://HOST:PORT or grpcs://HOST:PORT, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"controller URL needs a host and a port, got {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"ca", "cert", "key", "server_name"}
    if unknown:
        raise ValueError(f"unknown controller URL options {sorted(unknown)}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    ca = tls_ca or query.get("ca")
    return Target(f"{host}:{port}", parts.scheme == "grpcs" or ca is not None, ca, query.get("cert"),
                  query.get("key"), query.get("server_name"))


def sync_channel(target: Target) -> grpc.Channel:
    """A blocking channel to ``target`` (TLS as it says)."""
    if target.tls:
        return grpc.secure_channel(target.address, target.credentials(), options=target.options())
    return grpc.insecure_channel(target.address, options=target.options())


def aio_channel(target: Target) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (TLS as it says)."""
    if target.tls:
        return grpc.aio.secure_channel(target.address, target.credentials(), options=target.options())
    return grpc.aio.insecure_channel(target.address, options=target.options())
