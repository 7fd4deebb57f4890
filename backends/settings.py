"""The built-in tiers' settings: what each declares through the ``kvlayer.tier_settings`` entry points.

Deliberately light (it imports only ``kvlayer.tier_settings``): every config loads it, so a
process that enables no Redis never imports redis-py, nor torch for the CLI. Each setting is
written either inside the tier's section (``tiers: {nvme: {path: /x}}``) or flat at the top level
(``nvme_path: /x``, ``KVLAYER_NVME_PATH``); docs/configuration.md lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlayer.tier_settings import Setting, TierSettings

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _has_capacity(section: Mapping[str, Any]) -> bool:
    return section["capacity"] > 0


def _probe_nvme(section: Mapping[str, Any], timeout_ms: int) -> str | None:
    from kvlayer.backends.probes import nvme_folder

    return nvme_folder(section, timeout_ms)


def _probe_redis(section: Mapping[str, Any], timeout_ms: int) -> str | None:
    from kvlayer.backends.probes import redis_ping

    return redis_ping(section, timeout_ms)


GPU = TierSettings(
    (Setting("capacity", "size", 0, "bytes of the device arena on the engine's device; 0 = off", memory="device"),),
    enabled=_has_capacity)

CPU = TierSettings(
    (Setting("capacity", "size", 4 * 1024**3, "bytes of the pinned host arena; 0 = off", memory="host"),),
    enabled=_has_capacity)

NVME = TierSettings(
    (Setting("path", "str | None", None, "folder of the chunk files; unset = off"),
     Setting("capacity", "size", 64 * 1024**3, "bytes of chunk files at most (LRU eviction)"),
     Setting("fsync", "bool", False, "fsync each chunk file before renaming it into place")),
    enabled=lambda s: s["path"] is not None and s["capacity"] > 0, place="path", probe=_probe_nvme)


def _check_redis(section: Mapping[str, Any]) -> None:
    url = section["url"]
    if url is not None and not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {url!r}")
    if section["ttl_s"] < 0:
        raise ValueError(f"redis_ttl_s must be >= 0, got {section['ttl_s']}")


REDIS = TierSettings(
    (Setting("url", "str | None", None, "redis://[user:pass@]host:port/db, rediss:// (TLS), unix://; unset = off"),
     Setting("cluster", "bool", False, "treat the URL as one node of a Redis Cluster"),
     Setting("ttl_s", "int", 0, "expire chunks after this many seconds; 0 = never"),
     Setting("key_prefix", "str", "kvlayer", "chunk K lives under <prefix>:{<K hex>} and <prefix>:{<K hex>}:b")),
    enabled=lambda s: s["url"] is not None, check=_check_redis, place="url", probe=_probe_redis)
