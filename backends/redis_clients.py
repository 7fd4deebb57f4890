"""The Redis tier's settings and the redis-py clients built from them, lazily, with no I/O, and
the few calls the tier (``backends/redis.py``) makes on them.

``RedisSettings`` holds what the tier is configured with (validated on construction).
``make_client`` gives the asyncio client: a plain one whose connections send a
``PiecewiseValue`` (a chunk's body: a view of its tensor) without ever copying it, or a
cluster client; ``sync_client`` a blocking one for occasional admin calls. ``pipeline`` sends
commands in one pipeline, and ``is_failure``/``raise_server_error`` sort error replies from
failed servers. The tier's fast reads use connections of their own (``backends/redis_wire.py``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvlayer import serde

_BIG_PIECE = 64 * 1024
"""Pieces at least this large are written alone, from their own memory."""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """The tier's settings, taken from ``KVLayerConfig`` (see ``backends/redis.py``)."""

    url: str
    cluster: bool = False
    ttl_s: int = 0
    prefix: str = "kvlayer"
    compression: str = "none"
    timeout_s: float = 2.0
    quantization: str = "none"
    """``storage_quantization``: how payloads are written, and the only encoding reads accept."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_s < 0:
            raise ValueError(f"redis_ttl_s must be >= 0, got {self.ttl_s}")
        if not self.prefix or any(c in self.prefix for c in "{}*?[]\\"):
            raise ValueError(f"redis_key_prefix must be non-empty, without {{}}*?[]\\, got {self.prefix!r}")
        if self.compression not in serde.COMPRESSION_CODES:
            raise ValueError(f"compression must be one of {sorted(serde.COMPRESSION_CODES)}")
        if self.quantization not in serde.QUANTIZATION_CODES:
            raise ValueError(f"quantization must be one of {sorted(serde.QUANTIZATION_CODES)}")
        if self.timeout_s <= 0:
            raise ValueError(f"tier_timeout_ms must be positive, got {self.timeout_s * 1000}")


@dataclass(frozen=True, slots=True)
class PiecewiseValue:
    """One Redis string value given as consecutive pieces (views of memory), never joined by
    ``_PiecewiseWrites``: joining would copy each multi-MiB payload into fresh memory."""

    pieces: tuple[bytes | memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces)

    def joined(self) -> bytes:
        return b"".join(self.pieces)


class _PiecewiseWrites:
    """Mixin for redis-py asyncio connections: pack a ``PiecewiseValue`` argument as one bulk string of
    several pieces, and send a packed command piece by piece.

    Each large piece (a value) is written alone, as a memoryview, and drained before the next,
    so the transport sends it from the value itself and copies only what the socket does not
    take at once. redis-py's ``send_packed_command`` still applies its timeout and error handling.
    """

    _writer: asyncio.StreamWriter
    encoder: Any

    def pack_command(self, *args: Any) -> list[bytes | memoryview]:
        if not any(isinstance(a, PiecewiseValue) for a in args):
            return super().pack_command(*args)  # type: ignore[misc]
        out: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for arg in args:
            pieces = arg.pieces if isinstance(arg, PiecewiseValue) else (self.encoder.encode(arg),)
            out.append(b"$%d\r\n" % sum(len(p) for p in pieces))
            out += pieces
            out.append(b"\r\n")
        return out

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        for piece in command:
            if len(piece) >= _BIG_PIECE:
                self._writer.write(memoryview(piece))
                await self._writer.drain()
            else:
                self._writer.write(piece)
        await self._writer.drain()


@functools.cache
def _piecewise(base: type) -> type:
    # A redis-py without the ``_send_packed_command`` hook still gets ``pack_command``.
    return type(f"Piecewise{base.__name__}", (_PiecewiseWrites, base), {})


def _timeouts(settings: RedisSettings) -> dict[str, Any]:
    return {"socket_timeout": settings.timeout_s, "socket_connect_timeout": settings.timeout_s}


def make_client(settings: RedisSettings) -> Any:
    """An asyncio client for ``settings`` (no I/O yet); one retry on a fresh connection, no backoff."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    if settings.cluster:
        from redis.asyncio.cluster import RedisCluster

        # No cluster-level retry: it would close every node's connections and sleep 0.25 s.
        return RedisCluster.from_url(settings.url, retry=Retry(NoBackoff(), 0), **_timeouts(settings))
    from redis.asyncio import ConnectionPool, Redis
    from redis.asyncio.connection import Connection, parse_url

    kwargs: dict[str, Any] = dict(parse_url(settings.url))
    base = kwargs.pop("connection_class", Connection)
    # One retry lets a call on a connection the server dropped (a restart) reconnect and succeed.
    pool = ConnectionPool(connection_class=_piecewise(base), **{**kwargs, **_timeouts(settings)},
                          retry=Retry(NoBackoff(), 1))
    return Redis.from_pool(pool)


def sync_client(settings: RedisSettings) -> Any:
    if settings.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(settings.url, **_timeouts(settings))
    from redis import Redis

    return Redis.from_url(settings.url, **_timeouts(settings))


# --- calls on those clients (used by backends/redis.py) ----------------------------------
def is_failure(reply: Any) -> bool:
    """Whether a reply says a server could not answer (down, timed out, cluster down)."""
    from redis.exceptions import ClusterError, ResponseError

    return isinstance(reply, BaseException) and (not isinstance(reply, ResponseError)
                                                 or isinstance(reply, ClusterError))


def raise_server_error(replies: Iterable[Any]) -> None:
    """Raise the first error reply about a command itself (e.g. OOM); node failures are counted."""
    for r in replies:
        if isinstance(r, BaseException) and not is_failure(r):
            raise r


async def pipeline(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one pipeline; per-command errors come back as exceptions in the list."""
    async with client.pipeline(transaction=False) as pipe:
        for cmd in commands:
            pipe.execute_command(*cmd)
        return list(await pipe.execute(raise_on_error=False))
