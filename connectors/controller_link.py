"""The one place an adapter links its ``KVCacheEngine`` to the cache controller (docs/architecture.md section 7).

Imported by every adapter; the agent (and grpc with it) is imported only when
``controller_url`` is set, so an engine without a controller never loads them.
"""

from __future__ import annotations

from typing import Any

from kvlayer.cache_engine import KVCacheEngine


def link_controller(kv: KVCacheEngine) -> Any:
    """The started ``kvlayer.controller.agent.ControllerAgent`` for ``kv`` (its config's
    ``controller_url``, ``controller_token`` and ``instance_address``), or None without a
    controller or when it cannot start (logged: the engine never fails for the controller)."""
    if not kv.config.controller_url:
        return None
    from kvlayer.controller.agent import start_agent

    return start_agent(kv, kv.config, address=kv.config.instance_address)
