"""Where the tiers keep their chunks, tried before an engine starts, and the line naming the tiers in effect.

A tier may declare a ``place`` (the setting naming its folder or URL: ``nvme_path``,
``redis_url``) and a ``probe`` for it (``kvlayer.tier_settings``). ``unusable(config)`` runs the
probes of the enabled tiers; ``kvlayer config --check`` reports each problem, and ``kvlayer
serve`` starts without those tiers (``without``) rather than miss on every lookup, and says
so in its start-up line (``tiers_line``). The core names no tier here: all of it comes from
the declarations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from kvlayer.sizes import format_size
from kvlayer.tier_settings import installed

if TYPE_CHECKING:
    from kvlayer.config import KVLayerConfig
    from kvlayer.storage import StorageBackend


@dataclass(frozen=True, slots=True)
class Unusable:
    """A tier whose place failed its probe: the tier, the place's flat key and the probe's line."""

    tier: str
    setting: str
    reason: str


def places(config: KVLayerConfig) -> list[str]:
    """The flat keys of the places ``config`` sets for its enabled tiers (those a probe would try)."""
    return [f"{tier}_{section.declaration.place}" for tier, section in sorted(config.tiers.items())
            if section.enabled and section.declaration.place and section[section.declaration.place] is not None]


def declared_places() -> list[str]:
    """The flat keys of every installed tier's place (``nvme_path``, ``redis_url``)."""
    return [f"{tier}_{d.place}" for tier, d in sorted(installed().items()) if d.place]


def unusable(config: KVLayerConfig) -> list[Unusable]:
    """The enabled tiers whose place its probe refuses (within ``tier_timeout_ms`` each), in tier order."""
    out = []
    for tier, section in sorted(config.tiers.items()):
        probe, place = section.declaration.probe, section.declaration.place
        if probe is None or not section.enabled or section[place] is None:
            continue
        reason = probe(section, config.tier_timeout_ms)
        if reason:
            out.append(Unusable(tier, f"{tier}_{place}", reason))
    return out


def without(config: KVLayerConfig, skipped: Sequence[Unusable]) -> KVLayerConfig:
    """``config`` with the tiers of ``skipped`` turned off (their place unset)."""
    return config.replace(**{u.setting: None for u in skipped}) if skipped else config


def tiers_line(backends: Sequence[StorageBackend], config: KVLayerConfig, skipped: Sequence[Unusable] = ()) -> str:
    """``"tiers cpu 4.0GiB, nvme /x 64.0GiB; nvme_path '/y' is not usable: ... (skipped)"``: each
    tier in effect, top first, with its place (a URL's password hidden) and capacity (none shown
    where the tier sets no bound of its own), then each skipped tier's reason."""
    shown = []
    for backend in backends:
        section = config.tiers.get(backend.name)
        place = section.declaration.place if section is not None else ""
        where = _hide_password(str(section[place])) if place and section[place] is not None else ""
        capacity = backend.usage()[1]
        shown.append(" ".join(w for w in (backend.name, where, format_size(capacity) if capacity else "") if w))
    line = f"tiers {', '.join(shown)}" if shown else "no tiers"
    return "; ".join([line, *(f"{u.reason} (skipped)" for u in skipped)])


def _hide_password(place: str) -> str:
    """``place`` with the password of a URL replaced by ``***``."""
    parts = urlsplit(place)
    if not parts.password:
        return place
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
