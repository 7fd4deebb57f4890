"""``KVLayerConfig``: the one typed, validated, frozen configuration (docs/architecture.md section 8).

Sources, later ones overriding earlier ones: defaults < a YAML file or a dict < ``KVLAYER_*``
environment variables (``KVLAYER_CPU_CAPACITY=4GiB``). An unknown key, a bad value or a
malformed YAML file raises ``ConfigError`` naming it, in one line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvlayer.sizes import parse_size

ENV_PREFIX = "KVLAYER_"
COMPRESSIONS = ("none", "lz4")
QUANTIZATIONS = ("none", "int8", "fp8")
"""The values of ``storage_quantization`` (``kvlayer.quantize`` implements the lossy ones)."""
INSTANCE_ROLES = ("both", "prefill", "decode")
"""What an instance does in prefill/decode disaggregation (``instance_role``): ``prefill`` computes
prompts only (decode instances read its KV through the shared tier), ``decode`` generates."""


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class KVLayerConfig:
    """kvlayer's settings. Sizes are bytes (strings like "4GiB" are accepted on construction).

    A capacity of 0 disables that tier; ``nvme_path``/``redis_url`` of None disable theirs.
    """

    chunk_size: int = 256
    gpu_capacity: int = 0
    cpu_capacity: int = 4 * 1024**3
    nvme_path: str | None = None
    nvme_capacity: int = 64 * 1024**3
    nvme_fsync: bool = False
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_ttl_s: int = 0
    redis_key_prefix: str = "kvlayer"
    compression: str = "none"
    storage_quantization: str = "none"
    """One of ``QUANTIZATIONS``: lossy int8/fp8 payloads in NVMe and Redis (``kvlayer.quantize``)."""
    save_decode_cache: bool = False
    save_partial_chunks: bool = False
    window_aware: bool = True
    """On a model with sliding windows, load a window layer's KV only where a query can still read
    it, and store a hybrid's window groups apart (``kvlayer.windows``); off: full KV, as for any model."""
    layerwise: str = "on"
    """``auto``, ``on`` or ``off`` (booleans mean on/off): see ``LAYERWISE``."""
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
    cache_salt: str = ""
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(f.name, f.type, value))
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
        if self.redis_ttl_s < 0:
            raise ConfigError(f"redis_ttl_s must be >= 0, got {self.redis_ttl_s}")
        if self.unhealthy_after <= 0:
            raise ConfigError(f"unhealthy_after must be positive, got {self.unhealthy_after}")
        if not 0 < self.unhealthy_backoff_ms <= self.unhealthy_backoff_max_ms:
            raise ConfigError("need 0 < unhealthy_backoff_ms <= unhealthy_backoff_max_ms, got "
                              f"{self.unhealthy_backoff_ms} and {self.unhealthy_backoff_max_ms}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in 0..65535 (0: off), got {self.metrics_port}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayerConfig:
        """From a mapping of key -> value; unknown keys raise ``ConfigError``."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"unknown kvlayer config key {key!r}; known keys: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVLayerConfig:
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
        """From a config, a dict or a YAML path (or defaults), then ``KVLAYER_*`` overrides."""
        if isinstance(source, KVLayerConfig):
            base = dataclasses.asdict(source)
        elif isinstance(source, Mapping):
            base = dict(source)
        elif source is None:
            base = {}
        else:
            base = dataclasses.asdict(cls.from_yaml(source))
        base.update(env_overrides(os.environ if env is None else env))
        return cls.from_dict(base)

    def replace(self, **changes: Any) -> KVLayerConfig:
        """A new config with ``changes`` applied (this one is never mutated)."""
        return KVLayerConfig.from_dict({**dataclasses.asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """The ``KVLAYER_<KEY>`` variables of ``env`` as config keys; unknown ones raise ``ConfigError``.

    Variables that name no config key but belong to other parts of kvlayer are ignored
    (``KVLAYER_ADMIN_TOKEN`` for the controller, ``KVLAYER_HOME`` for the CLI).
    """
    known = {f.name for f in fields(KVLayerConfig)}
    out = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_CONFIG:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in known:
            raise ConfigError(f"unknown kvlayer config variable {name}; known keys: {sorted(known)}")
        out[key] = value
    return out


_NOT_CONFIG = {"KVLAYER_ADMIN_TOKEN", "KVLAYER_HOME", "KVLAYER_LOG_LEVEL", "KVLAYER_SMOKE"}
_SIZE_KEYS = {"gpu_capacity", "cpu_capacity", "nvme_capacity", "staging_capacity"}
LAYERWISE = ("auto", "on", "off")
"""How loads reach the paged cache: ``on`` (the default), layer by layer on a loader thread while
the forward pass runs; ``off``, all of it before the forward pass; ``auto``, layer by layer on
CUDA and for steps that read NVMe or Redis, all at once for steps whose chunks are all in a CPU
memory tier, where a loader thread has no I/O to hide and only shares the cores with compute.
On 2 CPU cores ``on`` measured level with or ahead of ``off`` for every tier
(docs/benchmarks.md), so it is the default. Saves copy layer by layer unless ``off``."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, type_: Any, value: Any) -> Any:
    """Validate one field and convert strings (from YAML or the environment) to its type."""
    t = str(type_)
    optional = "None" in t
    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name} must not be empty")
    if name == "layerwise":
        return _layerwise(value)
    if name in _SIZE_KEYS:
        try:
            return parse_size(value)
        except ValueError as e:  # its message says what is wrong: keep it
            raise ConfigError(f"invalid value for {name}: {e}") from None
    try:
        if t.startswith("bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
            raise ValueError
        if t.startswith("int"):
            if isinstance(value, bool):
                raise ValueError
            return int(value) if isinstance(value, int) or str(value).strip().lstrip("-").isdigit() else _bad()
        if t.startswith("str"):
            if not isinstance(value, str | int) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except ValueError as e:
        raise ConfigError(f"invalid value for {name}: {value!r} (expected {t})") from e
    return value


def _layerwise(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).lower() if isinstance(value, str) else ""
    if text in LAYERWISE:
        return text
    if text in _TRUE | _FALSE:
        return "on" if text in _TRUE else "off"
    raise ConfigError(f"invalid value for layerwise: {value!r} (expected one of {LAYERWISE}, or a boolean)")


def _bad() -> Any:
    raise ValueError


def _yaml_problem(error: Exception) -> str:
    """One line out of a PyYAML error (whose own text spans several): the problem and where."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem
