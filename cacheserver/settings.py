"""The ``cache`` tier's settings (docs/architecture.md section 8): a client of ``kvlayer cache-server``.

Light on purpose (it imports only ``kvlayer.tier_settings``): every config loads it. Written flat
as ``cache_server`` / ``cache_server_token`` (``KVLAYER_CACHE_SERVER``), or in the section
``tiers: {cache: {server: PATH}}``; docs/configuration.md lists them. With a server set, the
process keeps no CPU tier of its own (``cpu_capacity`` defaults to 0) unless the config sets one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlayer.tier_settings import Setting, TierSettings


def _check(section: Mapping[str, Any]) -> None:
    server = section["server"]
    if server is not None and len(server.encode()) > 107:
        raise ValueError(f"cache_server must be a Unix socket path of at most 107 bytes, got {server!r}")


CACHE = TierSettings(
    (Setting("server", "str | None", None, "Unix socket of a kvlayer cache-server whose shared CPU tier this "
                                           "process uses; unset = off"),
     Setting("server_token", "str | None", None, "token presented to the cache server on connect")),
    enabled=lambda s: s["server"] is not None, check=_check,
    replaces=("cpu", "capacity", 0))  # the server's arena is this process's CPU tier: no private one beside it
