"""Ids of the stores several instances reach, so the controller's registry pools their chunks.

A tier registered with a ``shared_id`` is one pool of digests in the registry (``registry.py``):
every instance that registers the same id reaches the same chunks. Redis is shared by URL and
key prefix; a node cache server (``kvlayer cache-server``) by its host and socket path, which
its engine clients and the server itself compute alike.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from kvlayer.config import KVLayerConfig


def redis_shared_id(config: KVLayerConfig) -> str:
    """The same Redis (and key prefix) gives the same id, whatever the credentials in the URL."""
    url = urlsplit(config.redis_url or "")
    place = f"{url.scheme}://{url.hostname}:{url.port}{url.path}|{config.redis_key_prefix}|{config.redis_cluster}"
    return "redis-" + hashlib.blake2b(place.encode(), digest_size=8).hexdigest()


def cache_server_shared_id(socket_path: str) -> str:
    """The id of the arena of the cache server listening on ``socket_path`` on this host."""
    place = f"{socket.gethostname()}|{os.path.realpath(socket_path)}"
    return "cache-server-" + hashlib.blake2b(place.encode(), digest_size=8).hexdigest()


def _cache_shared_id(config: KVLayerConfig) -> str:
    return cache_server_shared_id(config.cache_server)


SHARED_TIERS: dict[str, Callable[[KVLayerConfig], str]] = {"redis": redis_shared_id, "cache": _cache_shared_id}
"""Tiers other instances reach too, by name -> the shared store's id for a configuration."""

REPORTED_ELSEWHERE = frozenset({"cache"})
"""Shared tiers whose chunks another process reports: an engine's agent sends neither snapshot nor
events for them (the cache server registers its arena itself)."""
