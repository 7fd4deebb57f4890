"""Fixtures for the backend tests: throwaway Redis servers (tests using them skip without redis-server).

``redis_server`` is one fresh server per test (it starts in a few milliseconds);
``redis_cluster`` is a fresh 3-node Redis Cluster per test (about 3 s to form).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisClusterNodes, RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes() as cluster:
        yield cluster
