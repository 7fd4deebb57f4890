"""Finds and builds the storage tiers: entry points of the ``kvlayer.backends`` group.

The core never imports a backend by name (docs/architecture.md section 1): ``build_backends``
loads each entry point, calls ``cls.create(ctx)`` and keeps the tiers the configuration
enables, top tier first. A tier whose declared settings (``kvlayer.tier_settings``) say the
configuration disables it (no URL, no folder, capacity 0) is not even imported, so a tier's
optional dependency is imported only by a process that uses the tier. Tiers are known here by
their entry point names only.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points

from kvlayer.storage import BackendContext, StorageBackend

log = logging.getLogger(__name__)

GROUP = "kvlayer.backends"


class BackendLoadError(ImportError):
    """An enabled tier's entry point could not be imported; the message names it."""


def available_backends() -> dict[str, EntryPoint]:
    """Every installed backend entry point, by tier name (nothing is imported)."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def build_backends(ctx: BackendContext) -> list[StorageBackend]:
    """The tiers ``ctx.config`` enables, sorted by ``rank`` (top tier first).

    A tier is skipped unimported when its section of the config (``ctx.config.tiers``) says it
    is disabled (``Section.enabled``); a tier that declares no settings is always imported.
    Raises ``BackendLoadError`` naming the tier when an enabled tier fails to import,
    ``TypeError`` if an entry point is not a ``StorageBackend`` subclass, and whatever
    ``create`` raises for a bad setting (``ValueError`` naming it).
    """
    built: list[StorageBackend] = []
    for name, ep in sorted(available_backends().items()):
        section = ctx.config.tiers.get(name)
        if section is not None and not section.enabled:
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
