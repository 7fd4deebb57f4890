"""The configurations every benchmark compares side by side, selected with ``--configs``.

- ``recompute``: no prefix cache, no kvlayer (every prompt token computed);
- ``engine``: the engine's own prefix cache only (GPU blocks, lost on eviction);
- ``cpu``, ``cpu+nvme``, ``nvme``, ``redis`` (and ``gpu``): kvlayer with those tiers;
- ``<kvlayer configuration>:<quantization>`` (``nvme:int8``, ``redis:fp8``, ``cpu+nvme:int8``):
  that configuration with ``storage_quantization`` set, lossy payloads in its NVMe or Redis
  tier. Only configurations with such a tier take one (``cpu:int8`` is refused: the memory
  tiers keep exact tensors); ``parse_name`` splits and checks a name.

``ConfigFactory`` owns what the kvlayer configurations need for one run: a fresh, empty NVMe
folder per built configuration (under ``--cache-dir``, deleted at the end, so no run sees
another's chunks), and a Redis server (``--redis-url``, or a local ``redis-server`` started on
a free loopback port by ``redis_local``; a per-build key prefix keeps runs apart). Without
either, ``redis`` is left out with a note.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvlayer.benchmarks.common import checked_text, positive_int, redact_url, size_or_auto, size_text
from kvlayer.config import QUANTIZATIONS
from kvlayer.sizes import parse_size

BASELINES: dict[str, bool] = {"recompute": False, "engine": True}
"""Baseline name -> whether the engine's prefix cache is on."""


@dataclass(frozen=True, slots=True)
class TierSizes:
    """Chunk size and tier capacities (bytes) shared by every kvlayer configuration of a run."""

    chunk_size: int = 256
    cpu_capacity: int = 2 * 1024**3
    nvme_capacity: int = 16 * 1024**3
    gpu_capacity: int = 1024**3


@dataclass(frozen=True, slots=True)
class _Places:
    nvme_path: str
    redis_url: str | None
    redis_prefix: str
    redis_ttl_s: int


@dataclass(frozen=True, slots=True)
class _Tiers:
    """A kvlayer configuration: its tier settings, and the tier its hits come from once the
    memory tiers above it are emptied (``bench ttft`` measures that one)."""

    settings: Callable[[TierSizes, _Places], dict[str, Any]]
    lowest: str


_TIERS: dict[str, _Tiers] = {
    "cpu": _Tiers(lambda s, p: {"cpu_capacity": s.cpu_capacity}, "cpu"),
    "cpu+nvme": _Tiers(lambda s, p: {"cpu_capacity": s.cpu_capacity, "nvme_path": p.nvme_path,
                                     "nvme_capacity": s.nvme_capacity}, "nvme"),
    "nvme": _Tiers(lambda s, p: {"cpu_capacity": 0, "nvme_path": p.nvme_path, "nvme_capacity": s.nvme_capacity},
                   "nvme"),
    "redis": _Tiers(lambda s, p: {"cpu_capacity": 0, "redis_url": p.redis_url, "redis_key_prefix": p.redis_prefix,
                                  "redis_ttl_s": p.redis_ttl_s}, "redis"),
    "gpu": _Tiers(lambda s, p: {"gpu_capacity": s.gpu_capacity, "cpu_capacity": 0}, "gpu"),
}
"""kvlayer configuration name -> its tiers."""

QUANTIZED_TIERS = ("nvme", "redis")
"""The tiers whose payloads ``storage_quantization`` encodes (the memory tiers keep exact tensors)."""
LOSSY = tuple(q for q in QUANTIZATIONS if q != "none")
"""The quantizations a configuration name may carry after a colon."""

ALL_CONFIGS: tuple[str, ...] = (*BASELINES, *_TIERS)
DEFAULT_CONFIGS = "recompute,engine,cpu,cpu+nvme,nvme,redis"


class ConfigName(NamedTuple):
    """A ``--configs`` name split at its colon: ``base``, one of ``ALL_CONFIGS``, and
    ``quantization``, ``none`` or one of ``LOSSY``."""

    base: str
    quantization: str


def parse_name(name: str) -> ConfigName:
    """``name`` (``nvme``, ``nvme:int8``) split and checked; ValueError, in one line, for an
    unknown configuration or quantization, or a quantization where nothing stores it (a
    baseline, or a configuration without an NVMe or Redis tier)."""
    base, colon, quantization = name.partition(":")
    if base not in ALL_CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(ALL_CONFIGS)} (those with an "
                         f"NVMe or Redis tier also as <name>:{' or <name>:'.join(LOSSY)})")
    if not colon:
        return ConfigName(base, "none")
    if quantization not in LOSSY:
        raise ValueError(f"unknown storage quantization {quantization!r} in {name!r}; choose from {', '.join(LOSSY)}")
    if base in BASELINES:
        raise ValueError(f"{name!r}: {base} runs without kvlayer, so it has no storage to quantize")
    tier = _TIERS[base].lowest
    if tier not in QUANTIZED_TIERS:
        with_lower = ", ".join(f"{n}:{quantization}" for n, t in _TIERS.items() if t.lowest in QUANTIZED_TIERS)
        raise ValueError(f"{name!r}: storage_quantization applies only to the NVMe and Redis tiers and the "
                         f"{tier.upper()} tier keeps exact tensors; use a configuration with one ({with_lower})")
    return ConfigName(base, quantization)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One configuration as built for a run. ``kv_config`` None means kvlayer is off."""

    name: str
    label: str
    prefix_caching: bool
    kv_config: Mapping[str, Any] | None

    @property
    def uses_kvlayer(self) -> bool:
        return self.kv_config is not None

    @property
    def base(self) -> str:
        """The configuration without its quantization (``nvme`` for ``nvme:int8``)."""
        return parse_name(self.name).base

    @property
    def quantization(self) -> str:
        """Its ``storage_quantization`` (``none`` for exact storage and for the baselines)."""
        return "none" if self.kv_config is None else self.kv_config.get("storage_quantization", "none")

    @property
    def lowest_tier(self) -> str | None:
        """The tier its hits come from once the memory tiers above are emptied (None: no kvlayer)."""
        return None if self.kv_config is None else _TIERS[self.base].lowest

    def public_kv_config(self) -> dict[str, Any] | None:
        """``kv_config`` for reports: a Redis URL's password is masked."""
        if self.kv_config is None:
            return None
        kv = dict(self.kv_config)
        if kv.get("redis_url"):
            kv["redis_url"] = redact_url(kv["redis_url"])
        return kv

    @property
    def nvme_path(self) -> str | None:
        return None if self.kv_config is None else self.kv_config.get("nvme_path")

    @property
    def has_cpu_tier(self) -> bool:
        return self.kv_config is not None and self.kv_config.get("cpu_capacity", 0) > 0


def add_config_arguments(p: argparse.ArgumentParser, default_configs: str = DEFAULT_CONFIGS,
                         cpu_capacity: str = "2GiB") -> None:
    """``--configs``, ``--chunk-size``, the tier capacities, ``--cache-dir`` and ``--redis-url``."""
    p.add_argument("--configs", type=config_names, default=default_configs,
                   help=f"comma-separated, of {', '.join(ALL_CONFIGS)}; one with an NVMe or Redis tier may "
                        f"end in :{' or :'.join(LOSSY)} (quantized storage, e.g. nvme:int8)")
    p.add_argument("--chunk-size", type=positive_int, default=256, help="kvlayer chunk size in tokens")
    p.add_argument("--cpu-capacity", type=size_or_auto if cpu_capacity == "auto" else size_text, default=cpu_capacity,
                   help="kvlayer CPU tier size (e.g. 512MiB)" + (", or auto" if cpu_capacity == "auto" else ""))
    p.add_argument("--nvme-capacity", type=size_text, default="16GiB", help="kvlayer NVMe tier size")
    p.add_argument("--cache-dir", help="folder for the NVMe tier's files (default: HOME/cache/bench)")
    p.add_argument("--redis-url", help="Redis for the 'redis' configuration (default: start a local "
                                       "redis-server when one is installed)")


def parse_configs(text: str) -> list[str]:
    """The configuration names in ``text`` (comma-separated, order kept, duplicates dropped);
    ValueError names a bad one (see ``parse_name``)."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    for n in names:
        parse_name(n)
    if not names:
        raise ValueError("--configs names no configuration")
    return names


config_names = checked_text(parse_configs)
"""``--configs``' ``type=``: the text, checked by ``parse_configs``."""


class ConfigFactory:
    """Builds ``BenchConfig``s for one run and owns their NVMe folders and Redis server.

    ``kvlayer_prefix_caching``: whether the kvlayer configurations keep the engine's own
    prefix cache on (True: kvlayer below the engine's cache, as deployed; False: every hit
    comes from kvlayer, to measure the tiers). Use as a context manager, or call ``close()``.
    """

    def __init__(self, sizes: TierSizes, cache_root: str, redis_url: str | None, want_redis: bool,
                 kvlayer_prefix_caching: bool) -> None:
        from kvlayer.benchmarks.redis_local import LocalRedis

        self.sizes = sizes
        self.kvlayer_prefix_caching = kvlayer_prefix_caching
        Path(cache_root).mkdir(parents=True, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix="run-", dir=cache_root)
        self._stack = ExitStack()
        self._stack.callback(shutil.rmtree, self.root, ignore_errors=True)
        self.redis_url = redis_url
        if redis_url is None and want_redis and LocalRedis.available():
            try:
                self.redis_url = self._stack.enter_context(LocalRedis()).url
            except BaseException:
                self._stack.close()
                raise
        self._redis_ttl_s = 3600 if redis_url else 0  # a server of the user's: let our keys expire
        self._run_id = uuid.uuid4().hex[:8]
        self._built = 0

    def available(self, names: list[str]) -> list[str]:
        """``names`` without the ``redis`` ones (``redis:int8`` too) when no Redis is at hand (printing why)."""
        redis = [n for n in names if parse_name(n).base == "redis"]
        if redis and self.redis_url is None:
            which = " and ".join(repr(n) for n in redis)
            print(f"note: no --redis-url and no redis-server binary: the {which} "
                  f"configuration{'s are' if len(redis) > 1 else ' is'} left out")
            return [n for n in names if n not in redis]
        return names

    def build(self, name: str, layerwise: bool | str = "on", label: str | None = None,
              window_aware: bool = True, verify_fraction: float = 0.0) -> BenchConfig:
        """A fresh configuration: kvlayer ones get an empty NVMe folder and their own Redis keys
        (and ``storage_quantization`` from a ``:int8``/``:fp8`` suffix; ``window_aware`` False
        loads full KV on a model with sliding windows; ``verify_fraction`` as the config key);
        ValueError as ``parse_name``."""
        base, quantization = parse_name(name)
        if base in BASELINES:
            return BenchConfig(name, label or name, BASELINES[base], None)
        if base == "redis" and self.redis_url is None:
            raise ValueError(f"the {name!r} configuration needs --redis-url or a redis-server binary")
        self._built += 1
        folder = os.path.join(self.root, f"{name.replace('+', '-').replace(':', '-')}-{self._built}")
        places = _Places(folder, self.redis_url, f"kvbench-{self._run_id}-{self._built}", self._redis_ttl_s)
        kv = {"chunk_size": self.sizes.chunk_size, "layerwise": layerwise, **_TIERS[base].settings(self.sizes, places)}
        if quantization != "none":  # exact configurations keep the key unset, as before
            kv["storage_quantization"] = quantization
        if not window_aware:
            kv["window_aware"] = False
        if verify_fraction:
            kv["verify_fraction"] = verify_fraction
        return BenchConfig(name, label or name, self.kvlayer_prefix_caching, kv)

    def close(self) -> None:
        """Delete the NVMe folders and stop a Redis server this factory started; idempotent."""
        self._stack.close()

    def __enter__(self) -> ConfigFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def factory_from_args(args: argparse.Namespace, names: list[str], kvlayer_prefix_caching: bool,
                      cpu_capacity: int | None = None) -> ConfigFactory:
    """A ``ConfigFactory`` from the arguments of ``add_config_arguments`` (``cpu_capacity``
    overrides ``--cpu-capacity``, for benchmarks that size it themselves)."""
    sizes = TierSizes(chunk_size=args.chunk_size,
                      cpu_capacity=cpu_capacity if cpu_capacity is not None else parse_size(args.cpu_capacity),
                      nvme_capacity=parse_size(args.nvme_capacity))
    root = args.cache_dir or os.path.join(args.home, "cache", "bench")
    want_redis = any(parse_name(n).base == "redis" for n in names)
    return ConfigFactory(sizes, root, args.redis_url, want_redis, kvlayer_prefix_caching)


def drop_page_cache(folder: str | None) -> int:
    """Write back and evict from the OS page cache every file under ``folder``, so the next read
    comes from the disk (``posix_fadvise(DONTNEED)``, no root needed); returns how many files."""
    if not folder or not os.path.isdir(folder):
        return 0
    n = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:  # renamed or evicted meanwhile
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def make_llm(model: str, device: str, config: BenchConfig, *, num_gpu_blocks: int | None = None,
             kv_cache_memory: str | None = None, max_num_batched_tokens: int = 4096) -> Any:
    """An ``LLM`` running ``config`` (its prefix-cache setting and kvlayer configuration)."""
    from kvlayer.engine import LLM

    kv = dict(config.kv_config) if config.kv_config is not None else None
    return LLM(model, device=device, enable_prefix_caching=config.prefix_caching, num_gpu_blocks=num_gpu_blocks,
               kv_cache_memory=kv_cache_memory, max_num_batched_tokens=max_num_batched_tokens, kv_config=kv)


def tier_hit_tokens(stats: Mapping[str, Any]) -> dict[str, int]:
    """Tokens each kvlayer tier has served so far (``hit_tokens`` of ``LLM.kv_stats()``)."""
    return {name: int(t.get("hit_tokens", 0)) for name, t in stats.get("tiers", {}).items()}
