"""Tests of how the Redis tier (backends/redis.py) reaches its server: a second process reading
what the first wrote, ACL users and passwords, and TLS.

Run: ``.venv/bin/python -m pytest tests/backends/test_redis_connections.py`` (skips without
redis-server). The child process of ``test_second_process_reads`` imports ``_child_reads`` from here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.backends.test_redis import ROOT, check_and_release, keys_of, opened, put_keys, run, tls_server
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


def _child_reads(url: str, seed: str, n: str) -> None:
    """In the child process: read ``n`` chunks of ``seed`` and print which hit exactly."""
    keys = keys_of(int(n), int(seed))

    async def main() -> list[bool]:
        async with opened(url) as backend:
            return check_and_release(await backend.get_many(keys), keys)

    print(json.dumps(run(main())))


def test_second_process_reads(redis_server: RedisServer) -> None:
    keys = keys_of(4, seed=7)

    async def main() -> None:
        async with opened(redis_server.url) as backend:
            await put_keys(backend, keys[:3])

    run(main())
    code = f"import sys; sys.path.insert(0, {ROOT!r}); " \
           "from tests.backends.test_redis_connections import _child_reads; _child_reads(*sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, redis_server.url, "7", "4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True, False]


def test_password_and_acl_user() -> None:
    args = ["--requirepass", "s3cret", "--user", "alice", "on", ">wonder", "~kvlayer:*", "+@all"]
    with RedisServer(args) as server:
        base = f"127.0.0.1:{server.port}"
        keys = keys_of(2)

        async def main() -> None:
            async with opened(f"redis://:s3cret@{base}") as backend:
                await put_keys(backend, keys)
            async with opened(f"redis://alice:wonder@{base}") as backend:
                assert check_and_release(await backend.get_many(keys), keys) == [True, True]
            for bad in (f"redis://:wrong@{base}", f"redis://alice:wrong@{base}", f"redis://{base}"):
                async with opened(bad, tier_timeout_ms=1000) as backend:
                    start = time.monotonic()
                    with pytest.raises(Exception, match="(?i)auth|password|invalid"):
                        await backend.get_many(keys)
                    assert time.monotonic() - start < 1.0

        run(main())


def test_tls(tmp_path: Path) -> None:
    keys = keys_of(3)

    async def main(url: str) -> None:
        async with opened(url) as backend:
            await put_keys(backend, keys)
            assert check_and_release(await backend.get_many(keys), keys) == [True] * 3

    with tls_server(tmp_path) as url:
        run(main(url))
