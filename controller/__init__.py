"""kvlayer's cache controller (ARCHITECTURE.md section 7): see the fleet's cache from one place.

- ``kvlayer.controller.server``: the gRPC server (``kvlayer controller``): a registry of which
  instance holds which chunks per tier, admin RPCs, the standard health service.
- ``kvlayer.controller.agent``: the instance side, started by the connector when
  ``controller_url`` is set; a background thread that never blocks the engine.
- ``kvlayer.controller.client``: ``AdminClient`` and ``best_instance`` (KV-aware routing).
- ``kvlayer.controller.cli``: ``kvlayer controller`` and ``kvlayer admin``.

Importing this package is light (no grpc); ``best_instance`` imports the client when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlayer.controller.client import Route


def best_instance(token_ids: Sequence[int], model: str, **client_options: Any) -> Route | None:
    """The instance to send a request for ``token_ids`` of ``model`` to: the one caching the longest
    prefix (ties: the one holding more of it in its own tiers rather than a shared one, then the
    lowest id); None when no live instance serves ``model``.

    ``client_options`` go to ``kvlayer.controller.client.AdminClient`` (address, token, tls_ca,
    timeout). Raises ``ControllerError`` when the controller refuses the lookup.
    """
    from kvlayer.controller.client import best_instance as _best

    return _best(token_ids, model, **client_options)


__all__ = ["best_instance"]
