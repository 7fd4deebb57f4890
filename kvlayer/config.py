"""``KVLayerConfig``: the one typed, validated, frozen configuration (docs/architecture.md section 8).

Sources, later ones overriding earlier ones: defaults < a YAML file or a dict < ``KVLAYER_*``
environment variables (``KVLAYER_CPU_CAPACITY=4GiB``). An unknown key, a bad value or a
malformed YAML file raises ``ConfigError`` naming it, in one line.

The core's own settings are this class's fields. The tiers' settings are declared by the tiers
(``kvlayer.tier_settings``) and live in ``tiers``, one ``Section`` per installed tier; each is
written either in the tier's section (``tiers: {nvme: {path: /x}}``) or flat (``nvme_path: /x``,
also read as ``config.nvme_path``). Where one source gives both spellings of a setting, the
section's wins (so a section merged into a ``to_dict()`` overrides it); a later source overrides
an earlier one whichever spelling either uses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvlayer.tier_settings import FrozenMap, Section, TierSettings, flat_keys, installed, resolve_tiers
from kvlayer.values import FALSE_WORDS, TRUE_WORDS, ConfigError, parse_value

__all__ = ["ConfigError", "KVLayerConfig", "env_overrides"]

ENV_PREFIX = "KVLAYER_"
COMPRESSIONS = ("none", "lz4")
QUANTIZATIONS = ("none", "int8", "fp8")
"""The values of ``storage_quantization`` (``kvlayer.quantize`` implements the lossy ones)."""
INSTANCE_ROLES = ("both", "prefill", "decode")
"""What an instance does in prefill/decode disaggregation (``instance_role``): ``prefill`` computes
prompts only (decode instances read its KV through the shared tier), ``decode`` generates."""
TIERS = "tiers"
"""The key of the tiers' sections."""


@dataclass(frozen=True, slots=True, init=False)
class KVLayerConfig:
    """kvlayer's settings. Sizes are bytes (strings like "4GiB" are accepted on construction).

    ``KVLayerConfig(**values)`` takes the fields below, ``tiers`` (tier name -> its settings) and
    any tier's flat keys (``cpu_capacity=0``, ``nvme_path="/x"``); ``ConfigError`` for anything
    else. ``tiers`` then holds a ``Section`` for every installed tier that declares settings,
    defaults filled in, and ``config.<tier>_<key>`` reads one of them.
    """

    chunk_size: int = 256
    compression: str = "none"
    """``none`` or ``lz4``: how serialising tiers compress payloads."""
    storage_quantization: str = "none"
    """One of ``QUANTIZATIONS``: lossy int8/fp8 payloads in serialising tiers (``kvlayer.quantize``)."""
    save_decode_cache: bool = False
    save_partial_chunks: bool = False
    window_aware: bool = True
    """On a model with sliding windows, load a window layer's KV only where a query can still read
    it, and store a hybrid's window groups apart (``kvlayer.windows``); off: full KV, as for any model."""
    layerwise: str = "on"
    """``auto``, ``on`` or ``off`` (booleans mean on/off): see ``LAYERWISE``."""
    async_loads: bool = True
    """vLLM's connector: a hit read from a tier below memory (NVMe, Redis) loads in the background
    (vLLM's ``load_kv_async``) while the other requests keep decoding; off: every load in the step."""
    staging_capacity: int = 512 * 1024**2
    tier_timeout_ms: int = 2000
    unhealthy_after: int = 3
    unhealthy_backoff_ms: int = 1000
    unhealthy_backoff_max_ms: int = 30000
    controller_url: str | None = None
    controller_token: str | None = None
    instance_address: str = ""
    instance_id: str | None = None
    instance_role: str = "both"
    """One of ``INSTANCE_ROLES``; registered with the controller, where routers read it."""
    served_model_name: str = ""
    """The name clients ask for the model by (``kvlayer serve`` sets it: ``--served-model-name``, else
    ``--model`` as given), registered with the controller beside the key namespace's model name, so
    admin calls and router lookups may use either; "": the namespace's name only. Not in the keys."""
    cache_salt: str = ""
    verify_fraction: float = 0.0
    """The share of hits, in [0, 1], that are recomputed and compared with the stored KV instead
    of loaded (``kvlayer.verify``, docs/architecture.md section 14); 0: none."""
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    tiers: Mapping[str, Section] = field(default_factory=FrozenMap)
    """Tier name -> its ``Section`` (``kvlayer.tier_settings``): frozen, every declared setting typed."""

    def __init__(self, **values: Any) -> None:
        declared = installed()
        given = _canonical(values, declared)
        for f in fields(self):
            if f.name != TIERS:
                object.__setattr__(self, f.name, _coerce(f.name, _FIELD_KINDS.get(f.name, str(f.type)),
                                                         given.get(f.name, f.default)))
        object.__setattr__(self, TIERS, resolve_tiers(given[TIERS], declared))
        self._validate()

    def _validate(self) -> None:
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.storage_quantization not in QUANTIZATIONS:
            raise ConfigError(f"storage_quantization must be one of {QUANTIZATIONS}, "
                              f"got {self.storage_quantization!r}")
        if self.instance_role not in INSTANCE_ROLES:
            raise ConfigError(f"instance_role must be one of {INSTANCE_ROLES}, got {self.instance_role!r}")
        if self.tier_timeout_ms <= 0:
            raise ConfigError(f"tier_timeout_ms must be positive, got {self.tier_timeout_ms}")
        if self.unhealthy_after <= 0:
            raise ConfigError(f"unhealthy_after must be positive, got {self.unhealthy_after}")
        if not 0 < self.unhealthy_backoff_ms <= self.unhealthy_backoff_max_ms:
            raise ConfigError("need 0 < unhealthy_backoff_ms <= unhealthy_backoff_max_ms, got "
                              f"{self.unhealthy_backoff_ms} and {self.unhealthy_backoff_max_ms}")
        if not 0.0 <= self.verify_fraction <= 1.0:  # NaN fails too
            raise ConfigError(f"verify_fraction must be in [0, 1], got {self.verify_fraction}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in 0..65535 (0: off), got {self.metrics_port}")

    def __getattr__(self, name: str) -> Any:
        """A tier's setting by its flat key (``config.nvme_path`` is ``config.tiers["nvme"]["path"]``)."""
        if not name.startswith("_"):
            for tier, section in object.__getattribute__(self, TIERS).items():
                key = name[len(tier) + 1:]
                if name.startswith(f"{tier}_") and key in section:
                    return section[key]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayerConfig:
        """From a mapping of key -> value (fields, flat tier keys, ``tiers``); unknown keys raise ``ConfigError``."""
        return cls(**_canonical(data, installed()))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVLayerConfig:
        """From a YAML file holding a mapping of keys, as ``from_dict``; ``ConfigError`` naming the file
        for text that is not UTF-8, malformed YAML or not a mapping."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: malformed YAML: {_yaml_problem(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of kvlayer keys at the top level")
        return cls.from_dict(data)

    @classmethod
    def load(cls, source: KVLayerConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None) -> KVLayerConfig:
        """From a dict or a YAML path (or defaults), then ``KVLAYER_*`` overrides. A config object
        is taken as it is: the variables were applied when it was loaded, and applying them again
        would undo changes made to it since (``replace``)."""
        if isinstance(source, KVLayerConfig):
            return source
        if isinstance(source, Mapping):
            base = dict(source)
        elif source is None:
            base = {}
        else:
            base = cls.from_yaml(source).to_dict()
        declared = installed()
        under = _canonical(base, declared)
        over = _canonical(env_overrides(os.environ if env is None else env), declared)
        sections = {t: {**under[TIERS].get(t, {}), **over[TIERS].get(t, {})} for t in {*under[TIERS], *over[TIERS]}}
        return cls(**{**under, **over, TIERS: sections})

    def replace(self, **changes: Any) -> KVLayerConfig:
        """A new config with ``changes`` applied (this one is never mutated)."""
        return KVLayerConfig.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every setting as a plain dict: the fields, then each tier's under its flat keys (no ``tiers``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != TIERS}
        for _, section in sorted(self.tiers.items()):
            out.update(section.flat())
        return out


def _canonical(data: Mapping[str, Any], declared: Mapping[str, TierSettings]) -> dict[str, Any]:
    """``data`` with its flat tier keys moved into ``tiers`` (tier -> key -> value), the section's
    value kept where both spellings are given; ``ConfigError`` naming an unknown key."""
    flat = flat_keys(declared)
    out: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in flat:
            tier, name = flat[key]
            sections.setdefault(tier, {})[name] = value
        elif key in _FIELDS and key != TIERS:
            out[key] = value
        elif key != TIERS:
            known = sorted({*_FIELDS, *flat})
            raise ConfigError(f"unknown kvlayer config key {key!r}; known keys: {known}")
    for tier, section in _sections(data.get(TIERS)).items():
        sections.setdefault(tier, {}).update(section)
    out[TIERS] = sections
    return out


def _sections(value: Any) -> dict[str, Mapping[str, Any]]:
    """The ``tiers`` value as tier -> its given settings (a string is YAML: ``KVLAYER_TIERS``)."""
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"tiers: malformed YAML: {_yaml_problem(e)}") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"tiers must be a mapping of tier names to their settings, got {value!r}")
    out = {}
    for tier, section in value.items():
        if section is not None and not isinstance(section, Mapping):
            raise ConfigError(f"tiers.{tier} must be a mapping of setting names to values, got {section!r}")
        out[tier] = section or {}
    return out


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """The ``KVLAYER_<KEY>`` variables of ``env`` as config keys; unknown ones raise ``ConfigError``.

    ``<KEY>`` is a field or a tier's flat key (``KVLAYER_NVME_PATH``); ``KVLAYER_TIERS`` is a YAML
    mapping of sections. Variables that name no config key but belong to other parts of kvlayer
    are ignored (``KVLAYER_ADMIN_TOKEN`` for the controller, ``KVLAYER_HOME`` for the CLI).
    """
    known = {*_FIELDS, *flat_keys(installed())}
    out = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_CONFIG:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in known:
            raise ConfigError(f"unknown kvlayer config variable {name}; known keys: {sorted(known)}")
        out[key] = value
    return out


_FIELDS = frozenset(f.name for f in fields(KVLayerConfig))
_FIELD_KINDS = {"staging_capacity": "size"}
"""Fields whose kind (``kvlayer.values.KINDS``) is not their annotation."""
_NOT_CONFIG = {"KVLAYER_ADMIN_TOKEN", "KVLAYER_HOME", "KVLAYER_LOG_LEVEL", "KVLAYER_SMOKE"}
LAYERWISE = ("auto", "on", "off")
"""How loads reach the paged cache: ``on`` (the default), layer by layer on a loader thread while
the forward pass runs; ``off``, all of it before the forward pass; ``auto``, layer by layer on
CUDA and for steps that read NVMe or Redis, all at once for steps whose chunks are all in a CPU
memory tier, where a loader thread has no I/O to hide and only shares the cores with compute.
On 2 CPU cores ``on`` measured level with or ahead of ``off`` for every tier
(docs/benchmarks.md), so it is the default. Saves copy layer by layer unless ``off``."""


def _coerce(name: str, kind: str, value: Any) -> Any:
    """Validate one field and convert strings (from YAML or the environment) to its kind."""
    if name == "layerwise" and value is not None:
        return _layerwise(value)
    return parse_value(name, kind, value)


def _layerwise(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).lower() if isinstance(value, str) else ""
    if text in LAYERWISE:
        return text
    if text in TRUE_WORDS | FALSE_WORDS:
        return "on" if text in TRUE_WORDS else "off"
    raise ConfigError(f"invalid value for layerwise: {value!r} (expected one of {LAYERWISE}, or a boolean)")


def _yaml_problem(error: Exception) -> str:
    """One line out of a PyYAML error (whose own text spans several): the problem and where."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem
