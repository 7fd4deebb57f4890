"""The ``cache`` tier's settings (docs/architecture.md section 8): a client of ``kvlayer cache-server``.

Light on purpose (it imports only ``kvlayer.tier_settings``): every config loads it. Written flat
as ``cache_server`` / ``cache_server_token`` (``KVLAYER_CACHE_SERVER``), or in the section
``tiers: {cache: {server: PATH}}``; docs/configuration.md lists them. With a server set, the
process keeps no CPU tier of its own (``cpu_capacity`` defaults to 0) unless the config sets one.
The server's own settings (``cache_salt_quota``, ``cache_socket_group``, ``cache_metrics_port``)
live here too; clients ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvlayer.sizes import parse_size
from kvlayer.tier_settings import Setting, TierSettings


class VerifyRule(NamedTuple):
    """When a client may use a leased chunk without hashing it (``cache_server_verify``)."""

    trust_seal: bool
    """The server sealed it (hashed the arena bytes itself and found the checksum)."""
    trust_record: bool
    """This connection hashed the same commit before (``Link.is_verified``)."""
    record_writes: bool
    """A chunk this connection wrote and hashed counts as hashed by it."""


VERIFY_RULES = {"server": VerifyRule(True, True, True), "first": VerifyRule(False, True, False),
                "always": VerifyRule(False, False, False)}
"""``cache_server_verify`` (docs/cache-server.md, "What is verified"): ``server`` hashes what the
server has not sealed, once per connection; ``first`` every commit once per connection, sealed
or not; ``always`` every lease."""
VERIFY_MODES = tuple(VERIFY_RULES)


def quota_bytes(value: str, capacity: int) -> int:
    """A ``salt_quota`` in bytes: a fraction in (0, 1] of ``capacity`` ("0.25") or a size ("2GiB",
    more than 0); ``ValueError`` naming ``cache_salt_quota`` otherwise."""
    try:
        fraction = float(value)
    except ValueError:
        fraction = None
    if fraction is not None and "." in value:
        if not 0 < fraction <= 1:
            raise ValueError(f"cache_salt_quota must be a fraction in (0, 1] or a size, got {value!r}")
        return max(1, int(fraction * capacity))
    try:
        size = parse_size(value)
    except ValueError as e:
        raise ValueError(f"cache_salt_quota: {e}") from None
    if size <= 0:
        raise ValueError(f"cache_salt_quota must be more than 0 bytes, got {value!r}")
    return size


def _check(section: Mapping[str, Any]) -> None:
    server = section["server"]
    if server is not None and len(server.encode()) > 107:
        raise ValueError(f"cache_server must be a Unix socket path of at most 107 bytes, got {server!r}")
    if section["salt_quota"] is not None:
        quota_bytes(section["salt_quota"], 1)
    if section["server_verify"] not in VERIFY_MODES:
        raise ValueError(f"cache_server_verify must be one of {', '.join(VERIFY_MODES)}, "
                         f"got {section['server_verify']!r}")
    if not 0 <= section["metrics_port"] <= 65535:
        raise ValueError(f"cache_metrics_port must be in 0..65535 (0: off), got {section['metrics_port']}")


CACHE = TierSettings(
    (Setting("server", "str | None", None, "Unix socket of a kvlayer cache-server whose shared CPU tier this "
                                           "process uses; unset = off"),
     Setting("server_token", "str | None", None, "token presented to the cache server on connect"),
     Setting("server_verify", "str", "server", "which leased chunks this process hashes: server (those the "
                                               "server has not sealed), first (each commit once per "
                                               "connection), always (every lease)"),
     Setting("salt_quota", "str | None", None, "server: the most one tenant (cache_salt) holds, a size "
                                               "(\"2GiB\") or a fraction of the arena (\"0.25\"); unset = none"),
     Setting("socket_group", "str | None", None, "server: group of the socket and arena file, then mode 0660"),
     Setting("metrics_port", "int", 0, "server: port of its Prometheus /metrics (0: off)")),
    enabled=lambda s: s["server"] is not None, check=_check,
    replaces=("cpu", "capacity", 0))  # the server's arena is this process's CPU tier: no private one beside it
