"""``ControllerSettings``: the controller server's typed, validated, frozen settings.

Built by ``kvlayer controller`` from its flags (tokens from files or the environment) or
directly by tests and embedders. Every bound on hostile input lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:50051"
"""Loopback unless told otherwise (docs/architecture.md section 7)."""
MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """How the controller listens, whom it trusts and how much it accepts.

    ``admin_token``/``instance_token``: when set, admin / instance calls must carry
    ``authorization: Bearer <token>`` (compared in constant time). ``tls_cert``/``tls_key``
    (PEM files) switch the port to TLS; ``tls_client_ca`` also requires client certificates.
    ``tokenizers`` maps a model name to a ``tokenizer.json`` (or a folder holding one), for
    requests that send text instead of token ids.
    """

    listen: str = DEFAULT_LISTEN
    admin_token: str | None = None
    instance_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    command_timeout_s: float = 30.0
    max_message_bytes: int = 16 * MiB
    max_tokens: int = 131_072
    max_chunks_per_tier: int = 4_000_000
    max_instances: int = 1024
    forget_down_after_s: float = 600.0
    tokenizers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        for name in ("admin_token", "instance_token"):
            token = getattr(self, name)
            if token is not None and (not token or any(c.isspace() for c in token)):
                raise ValueError(f"{name} must be non-empty and contain no whitespace")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s, got "
                             f"{self.heartbeat_interval_s} and {self.heartbeat_timeout_s}")
        positive = ("command_timeout_s", "max_message_bytes", "max_tokens", "max_chunks_per_tier",
                    "max_instances", "forget_down_after_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_message_bytes < MiB:
            raise ValueError(f"max_message_bytes must be at least 1 MiB, got {self.max_message_bytes}")
        for model, path in self.tokenizers:
            if not model:
                raise ValueError("a tokenizer needs a model name")
            if not Path(path).exists():
                raise ValueError(f"tokenizer for {model!r}: {path} does not exist")

    @property
    def tls(self) -> bool:
        """Whether the port is TLS."""
        return self.tls_cert is not None


def parse_listen(listen: str) -> tuple[str, int]:
    """``(host, port)`` of a ``HOST:PORT`` to bind (``[::1]:50051`` for IPv6; port 0: any free
    one). ValueError naming ``listen`` for a missing host, or a port that is not in 0..65535
    (grpc would take 99999 modulo 65536)."""
    host, sep, port = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() for c in listen):
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen port must be 0..65535 (0: any free port), got {port!r} in {listen!r}")
    return host, int(port)
