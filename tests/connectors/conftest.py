"""Fixtures for the engine-level tests: the throwaway Redis servers of ``tests/backends``
(``redis_server``, ``redis_cluster``), which skip the tests using them without redis-server."""

from __future__ import annotations

from tests.backends.conftest import redis_cluster, redis_server

__all__ = ["redis_cluster", "redis_server"]
