"""Tiers declare their own settings (docs/architecture.md section 8): the ``kvlayer.tier_settings`` entry points.

A tier (built-in or third-party) names, in a light module that imports nothing heavy, a
``TierSettings``: its settings (key, kind, default, and for a size of memory it allocates at
start, where: ``memory``), the rule saying whether a config enables it, and optionally its
``place`` (the setting naming its folder or URL) with a ``probe`` that says why that place
cannot be used now (``kvlayer config --check`` and ``kvlayer serve`` run it: ``kvlayer.places``).
The entry point's name is the tier's name, the same as its ``kvlayer.backends`` entry point and
its backend's ``name``. ``KVLayerConfig`` resolves each tier's section of the config against
its declaration (``config.tiers[name]``, a ``Section``), and ``BackendContext.tier_settings``
hands a tier its own; the core never names a tier.

Each setting has two spellings, the same thing: ``key`` inside the tier's section (YAML
``tiers: {nvme: {path: /x}}``) and the flat key ``<tier>_<key>`` at the top level (``nvme_path: /x``,
``KVLAYER_NVME_PATH=/x``), which is also how messages name it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from kvlayer.values import OPTIONAL, ConfigError, check_kind, parse_value

GROUP = "kvlayer.tier_settings"


class FrozenMap(Mapping[str, Any]):
    """An immutable, hashable mapping of str keys (equal to any mapping with the same items)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "_items", dict(items or {}))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __copy__(self) -> FrozenMap:
        return self  # immutable, and so are its values (settings are scalars)

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenMap:
        return self

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"


MEMORY_PLACES = ("host", "device")
"""Where a ``Setting`` with ``memory`` allocates: host RAM, or the engine's device (host RAM too
when the engine runs on the CPU)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of a tier: ``key`` in its section (a lowercase identifier), its kind (one of
    ``kvlayer.values.KINDS``, optionally ``" | None"``), its default and one line saying what it means.
    ``memory`` (one of ``MEMORY_PLACES``, or ""): the setting is a size the tier allocates there
    when it starts, which ``kvlayer.capacity`` compares with the machine.

    ``ValueError`` on construction for a bad key, kind or memory place, or a default that is not of the kind.
    """

    key: str
    kind: str
    default: Any
    doc: str = ""
    memory: str = ""

    def __post_init__(self) -> None:
        if not (self.key.isidentifier() and self.key == self.key.lower() and not self.key.startswith("_")):
            raise ValueError(f"a setting's key must be a lowercase identifier, got {self.key!r}")
        check_kind(self.kind)
        parse_value(self.key, self.kind, self.default)
        if self.memory and (self.memory not in MEMORY_PLACES or self.kind != "size"):
            raise ValueError(f"setting {self.key!r}: memory must be one of {MEMORY_PLACES} on a size setting, "
                             f"got {self.memory!r} on a {self.kind!r}")


def _always(section: Mapping[str, Any]) -> bool:
    return True


def _nothing(section: Mapping[str, Any]) -> None:
    return None


Probe = Callable[[Mapping[str, Any], int], "str | None"]
"""(the tier's section, the core's ``tier_timeout_ms``) -> why its place cannot be used now, in one
line naming the flat key (None: it can). May do I/O (a probe file, a PING) within the timeout."""


@dataclass(frozen=True, slots=True)
class TierSettings:
    """What a tier declares about its settings.

    ``settings``: its keys, each once. ``enabled(section)``: whether a config whose section of
    this tier is ``section`` may enable it (False: ``build_backends`` does not even import the
    tier; the backend's ``create`` has the final say); default, always. ``check(section)``:
    cross-setting rules, raising ``ValueError`` whose message names the flat key; default, none.
    ``place``: the key of the setting naming where the tier keeps its chunks (a folder, a URL),
    of an optional kind whose None turns the tier off; ``probe`` (a ``Probe``, needs ``place``)
    says why a set place cannot be used now. Default: neither.
    """

    settings: tuple[Setting, ...]
    enabled: Callable[[Mapping[str, Any]], bool] = _always
    check: Callable[[Mapping[str, Any]], None] = _nothing
    place: str = ""
    probe: Probe | None = None
    replaces: tuple[str, str, Any] = ()
    """``(tier, key, value)``: while this tier is enabled it stands in for ``tier``, whose setting
    ``key`` then defaults to ``value`` (one that turns it off) unless the config gives it."""

    def __post_init__(self) -> None:
        keys = [s.key for s in self.settings]
        if len(set(keys)) != len(keys):
            raise ValueError(f"a tier declares each setting once, got {keys}")
        kinds = {s.key: s.kind for s in self.settings}
        if self.place and not kinds.get(self.place, "").endswith(OPTIONAL):
            raise ValueError(f"place must name one of the tier's optional settings, got {self.place!r}")
        if self.probe is not None and not self.place:
            raise ValueError("a probe needs the place it tries")
        if self.replaces and len(self.replaces) != 3:
            raise ValueError(f"replaces must be (tier, key, value), got {self.replaces!r}")

    def resolve(self, tier: str, given: Mapping[str, Any]) -> Section:
        """Tier ``tier``'s section from the values ``given`` (every other setting at its default).

        ``ConfigError`` naming the tier and key for a key it does not declare, naming the flat key
        for a value that is not of its kind or that ``check`` refuses.
        """
        known = {s.key: s for s in self.settings}
        for key in given:
            if key not in known:
                raise ConfigError(f"unknown setting {key!r} of tier {tier!r} (tiers.{tier}.{key}); "
                                  f"its settings: {sorted(known)}")
        values = {s.key: parse_value(f"{tier}_{s.key}", s.kind, given.get(s.key, s.default))
                  for s in self.settings}
        section = Section(tier, values, self)
        try:
            self.check(section)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return section


class Section(FrozenMap):
    """One tier's resolved settings: every key its declaration names, typed, defaults filled in."""

    __slots__ = ("tier", "declaration")

    def __init__(self, tier: str, values: Mapping[str, Any], declaration: TierSettings) -> None:
        super().__init__(values)
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "declaration", declaration)

    @property
    def enabled(self) -> bool:
        """Whether this section may enable its tier (``TierSettings.enabled``)."""
        return self.declaration.enabled(self)

    def flat(self) -> dict[str, Any]:
        """The settings under their flat keys, ``<tier>_<key>``."""
        return {f"{self.tier}_{key}": value for key, value in self.items()}


def flat_keys(declared: Mapping[str, TierSettings]) -> dict[str, tuple[str, str]]:
    """Flat key -> ``(tier, key)`` for every declared setting; ``ConfigError`` if two spell alike
    (tier ``a_b`` key ``c`` and tier ``a`` key ``b_c``)."""
    out: dict[str, tuple[str, str]] = {}
    for tier, declaration in sorted(declared.items()):
        for setting in declaration.settings:
            flat = f"{tier}_{setting.key}"
            if flat in out:
                other = out[flat]
                raise ConfigError(f"tiers {other[0]!r} and {tier!r} both declare the setting {flat!r}")
            out[flat] = (tier, setting.key)
    return out


def resolve_tiers(sections: Mapping[str, Mapping[str, Any]],
                  declared: Mapping[str, TierSettings]) -> FrozenMap:
    """Tier name -> ``Section`` for every declared tier, from the values given in ``sections``.

    ``ConfigError`` naming it for a section of a tier that declares no settings, or one that is
    not a mapping of settings; see ``TierSettings.resolve`` for the rest.
    """
    for tier, given in sections.items():
        if tier not in declared:
            raise ConfigError(f"tiers: no installed tier declares settings named {tier!r}; "
                              f"tiers with settings: {sorted(declared)}")
        if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
            raise ConfigError(f"tiers.{tier} must be a mapping of setting names to values, got {given!r}")
    out = {tier: d.resolve(tier, sections.get(tier, {})) for tier, d in sorted(declared.items())}
    for tier, d in sorted(declared.items()):  # an enabled tier standing in for another (``replaces``)
        if d.replaces and out[tier].enabled and d.replaces[0] in out:
            other, key, value = d.replaces
            given = sections.get(other, {})
            if key not in given:
                out[other] = declared[other].resolve(other, {**given, key: value})
    return FrozenMap(out)


@functools.cache
def installed() -> Mapping[str, TierSettings]:
    """Tier name -> its declaration, from the installed ``kvlayer.tier_settings`` entry points
    (loaded once per process). ``ConfigError`` naming the entry point if one cannot be imported
    or is not a ``TierSettings``, or if two tiers' flat keys collide."""
    out: dict[str, TierSettings] = {}
    for ep in entry_points(group=GROUP):
        try:
            declaration = ep.load()
        except Exception as e:
            raise ConfigError(f"tier settings {ep.name!r} ({ep.value}) could not be imported: {e}") from e
        if not isinstance(declaration, TierSettings):
            raise ConfigError(f"tier settings {ep.name!r} ({ep.value}) is not a TierSettings")
        out[ep.name] = declaration
    flat_keys(out)
    return FrozenMap(out)
