"""Finds and builds the storage tiers: entry points of the ``kvlayer.backends`` group.

The core never imports a backend by name (docs/architecture.md section 1): ``build_backends``
loads each entry point, calls ``cls.create(ctx)`` and keeps the tiers the configuration
enables, top tier first. Built-in tiers that the configuration plainly disables (no
``redis_url``, no ``nvme_path``, capacity 0) are not even imported, so a process without
Redis never imports ``redis``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from kvlayer.config import KVLayerConfig
from kvlayer.storage import BackendContext, StorageBackend

log = logging.getLogger(__name__)

GROUP = "kvlayer.backends"

_ENABLED_BY: dict[str, Callable[[KVLayerConfig], bool]] = {
    "gpu": lambda c: c.gpu_capacity > 0,
    "cpu": lambda c: c.cpu_capacity > 0,
    "nvme": lambda c: c.nvme_path is not None,
    "redis": lambda c: c.redis_url is not None,
}
"""For built-in tiers: whether the configuration may enable them (``create`` has the final say)."""


class BackendLoadError(ImportError):
    """An enabled tier's entry point could not be imported; the message names it."""


def available_backends() -> dict[str, EntryPoint]:
    """Every installed backend entry point, by tier name (nothing is imported)."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def build_backends(ctx: BackendContext) -> list[StorageBackend]:
    """The tiers ``ctx.config`` enables, sorted by ``rank`` (top tier first).

    Raises ``BackendLoadError`` naming the tier when an enabled built-in tier (or a
    third-party tier, whose enablement cannot be told without importing it) fails to import,
    ``TypeError`` if an entry point is not a ``StorageBackend`` subclass, and whatever
    ``create`` raises for a bad setting (``ValueError`` naming it).
    """
    built: list[StorageBackend] = []
    for name, ep in sorted(available_backends().items()):
        enabled = _ENABLED_BY.get(name)
        if enabled is not None and not enabled(ctx.config):
            continue
        cls = _load(name, ep)
        backend = cls.create(ctx)
        if backend is not None:
            built.append(backend)
    built.sort(key=lambda b: (b.rank, b.name))
    log.info("kvlayer tiers: %s", ", ".join(b.name for b in built) or "none")
    return built


def _load(name: str, ep: EntryPoint) -> type[StorageBackend]:
    try:
        cls = ep.load()
    except Exception as e:
        raise BackendLoadError(f"kvlayer backend {name!r} ({ep.value}) could not be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise TypeError(f"kvlayer backend {name!r} ({ep.value}) is not a StorageBackend subclass")
    return cls
