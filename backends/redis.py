"""The Redis tier: one Redis key per chunk, holding the serde header and the payload in one value.

Enabled by ``redis_url``: ``redis://host:port/db``, ``rediss://`` (TLS; options such as
``ssl_ca_certs`` go in the URL's query), ``unix://``; ``user:password@`` for ACLs.
``redis_cluster: true`` talks to a Redis Cluster, whose nodes share the chunks by key (no hash
tags). Chunk K lives under ``<redis_key_prefix>:<K hex>``, written by one ``SET NX`` (``EX
redis_ttl_s`` when > 0): a reader sees the whole chunk or nothing, never half of one.

Capacity is Redis's own (run it with ``maxmemory`` and ``allkeys-lru``): this tier evicts
nothing itself, ``pin``/``unpin`` pin nothing (they return 0), and chunks Redis evicts or
expires are not reported to the listener. ``usage()`` is the server's ``used_memory`` and
``maxmemory`` (summed over a cluster's primaries, all keys counted) as last sampled, at most
every ``USAGE_EVERY_S``, by the coroutine calls.

Faults: a value that is not a valid chunk for its key (garbage, truncated, another key's, a
flipped bit) is a miss counted in ``checksum_errors``, and the key is deleted. Every call is
bounded by ``tier_timeout_ms`` (socket and connect timeouts and an overall deadline);
connection errors and timeouts raise, and the next call reconnects by itself. In cluster mode
a batch is split into one pipeline per node: a node that fails makes its own keys misses
(``node_errors``) while the others answer; the call raises only if every node it needed failed.

Throughput: a value is never copied whole on the way out or in. ``backends/redis_clients.py`` packs a
value as its two pieces (the header, then the payload: a view of the chunk's tensor or its lz4
frame) and writes the pieces one by one: Python 3.11's ``StreamWriter.writelines`` would join
every piece into one new buffer and its transport copy that twice more (0.3 GiB/s for 6 MiB
values here, 2-3 GiB/s piecewise). ``GET`` replies are read by ``redis_reads.read_reply``,
which checks the header and hashes and copies the payload straight from the stream into the
staging tensor, skipping redis-py's reply parser and its copies. Redis Cluster clients take no
connection class, so in cluster mode values are joined once and replies go through redis-py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from kvlayer import serde
from kvlayer.backends.redis_clients import PiecewiseValue, make_client, sync_client
from kvlayer.backends.redis_layers import read_layers_on
from kvlayer.backends.redis_reads import Expected, Reply, decode_value, read_reply
from kvlayer.keys import KEY_BYTES, ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext, StorageBackend

log = logging.getLogger(__name__)
T = TypeVar("T")

COUNTERS = ("hits", "misses", "checksum_errors", "staging_full", "node_errors", "bytes_read",
            "bytes_written", "puts", "removed")
"""What ``stats()`` counts (``node_errors``: keys lost to a failing node in cluster mode)."""

USAGE_EVERY_S = 5.0
NODE_SHARE = 0.8
"""In cluster mode each node's pipeline gets this share of the deadline, so the others' answers
arrive before the call's deadline when one node hangs."""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """The tier's settings, taken from ``KVLayerConfig`` (see the module docstring)."""

    url: str
    cluster: bool = False
    ttl_s: int = 0
    prefix: str = "kvlayer"
    compression: str = "none"
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_s < 0:
            raise ValueError(f"redis_ttl_s must be >= 0, got {self.ttl_s}")
        if not self.prefix or any(c in self.prefix for c in "{}*?[]\\"):
            raise ValueError(f"redis_key_prefix must be non-empty, without {{}}*?[]\\, got {self.prefix!r}")
        if self.compression not in serde.COMPRESSION_CODES:
            raise ValueError(f"compression must be one of {sorted(serde.COMPRESSION_CODES)}")
        if self.timeout_s <= 0:
            raise ValueError(f"tier_timeout_ms must be positive, got {self.timeout_s * 1000}")


class RedisBackend(StorageBackend):
    """Chunks as Redis values (header + payload), read into ``staging``.

    ``get_many`` answers objects allocated from ``staging`` (one reference each, owned by the
    caller); ``put_many`` only reads the caller's chunks. The client is made on the first call
    and belongs to that call's event loop (a call from another loop makes a new one).
    """

    name = "redis"
    rank = 30

    def __init__(self, settings: RedisSettings, layout: KVLayout, staging: Arena) -> None:
        self.settings = settings
        self._layout = layout
        self._staging = staging
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefix = settings.prefix.encode() + b":"
        self._stats: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._usage = (0, 0)
        self._usage_at = float("-inf")
        self._tasks: set[asyncio.Task[None]] = set()
        self._logged: set[str] = set()
        self._closed = False

    @classmethod
    def create(cls, ctx: BackendContext) -> RedisBackend | None:
        """The tier, or None when ``redis_url`` is unset. No I/O (the client connects lazily)."""
        cfg = ctx.config
        if not cfg.redis_url:
            return None
        settings = RedisSettings(cfg.redis_url, cfg.redis_cluster, cfg.redis_ttl_s, cfg.redis_key_prefix,
                                 cfg.compression, cfg.tier_timeout_ms / 1000)
        return cls(settings, ctx.layout, ctx.staging)

    def redis_key(self, key: ChunkKey) -> bytes:
        """The Redis key of ``key``'s chunk: ``<prefix>:<key hex>``."""
        return self._prefix + key.hex.encode()

    # --- the StorageBackend interface -------------------------------------------------
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        async with self._deadline():
            replies = await self._run([("EXISTS", self.redis_key(k)) for k in keys])
        n = 0
        while n < len(keys) and replies[n] == 1:
            n += 1
        return n

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        if not keys:
            return []
        wants = [Expected(k, self._layout.chunk_shape(k.num_tokens), self._layout.dtype, self._staging)
                 for k in keys]
        async with self._deadline():
            if self.settings.cluster:
                replies = await self._get_cluster(wants)
            else:
                replies = await self._pooled(lambda conn: self._get_on(conn, wants))
        # No await from here on: the objects in the replies cannot leak to a cancellation.
        self._tally([(self.redis_key(k), r.obj is not None, r.nbytes, r.error, r.stored)
                     for k, r in zip(keys, replies)])
        return [r.obj for r in replies]

    async def read_layers(self, keys: Sequence[ChunkKey], outs: Sequence[MemoryObj],
                          groups: Sequence[tuple[int, int]], on_group: Callable[[int], None]) -> list[bool]:
        """``StorageBackend.read_layers`` with pipelined ``GETRANGE``s by layer group
        (``backends/redis_layers.py``); compressed values and cluster mode read whole values."""
        if self.settings.cluster or self.settings.compression != "none" or not keys:
            return await super().read_layers(keys, outs, groups, on_group)
        names = [self.redis_key(k) for k in keys]
        async with self._deadline():
            values = await self._pooled(lambda conn: _read_or_drop(
                conn, "GETRANGE", read_layers_on(conn, names, keys, outs, groups, on_group)))
        flags = [v.verified() for v in values]
        self._tally([(name, ok, v.nbytes, v.error, True) for name, ok, v in zip(names, flags, values)])
        return flags

    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Write each chunk not yet present (``SET NX``); ValueError for a chunk that does not fit its key.

        In cluster mode, chunks bound for a failing node are dropped (``node_errors``); a
        server error reply (e.g. OOM) raises after the other chunks are written.
        """
        if len(keys) != len(chunks):
            raise ValueError(f"{len(keys)} keys but {len(chunks)} chunks")
        if not keys:
            return
        values = [self._encode(k, c) for k, c in zip(keys, chunks)]
        expiry = ("EX", self.settings.ttl_s) if self.settings.ttl_s else ()
        # Cluster connections cannot send a value in pieces: there, each value is joined once.
        commands = [("SET", self.redis_key(k), v.joined() if self.settings.cluster else v, "NX", *expiry)
                    for k, v in zip(keys, values)]
        async with self._deadline():
            replies = await self._run(commands)
        new = [i for i, r in enumerate(replies) if r is True]
        self._stats["puts"] += len(new)
        self._stats["bytes_written"] += sum(values[i].nbytes for i in new)
        self._admitted([keys[i].digest for i in new])
        self._maybe_sample_usage()
        _raise_server_error(replies)

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        async with self._deadline():
            replies = await self._run([("DEL", self.redis_key(k)) for k in keys])
        gone = [k.digest for k, r in zip(keys, replies) if r == 1]
        self._stats["removed"] += len(gone)
        self._evicted(gone)
        return len(gone)

    def usage(self) -> tuple[int, int]:
        return self._usage

    def keys(self) -> list[bytes]:
        """Digests of every chunk under the prefix, by a blocking ``SCAN``: call it off the I/O loop."""
        client = sync_client(self.settings)
        try:
            names = client.scan_iter(match=self._prefix + b"*", count=1000)
            return [d for d in (self._digest_of(n) for n in names) if d is not None]
        finally:
            client.close()

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()

    # --- encoding and decoding --------------------------------------------------------
    def _encode(self, key: ChunkKey, chunk: MemoryObj) -> PiecewiseValue:
        """Header and payload as one value in two pieces; the payload is a view of the chunk (or its lz4 frame)."""
        shape = self._layout.chunk_shape(key.num_tokens)
        if tuple(chunk.shape) != shape or chunk.dtype != self._layout.dtype:
            raise ValueError(f"chunk {tuple(chunk.shape)} {chunk.dtype} does not fit key "
                             f"{key.hex[:16]} (expected {shape} {self._layout.dtype})")
        tensor = chunk.tensor if chunk.tensor.device.type == "cpu" else chunk.tensor.cpu()
        return PiecewiseValue(serde.encode_chunk(key, tensor, self.settings.compression))

    def _tally(self, reads: Sequence[tuple[bytes, bool, int, Exception | None, bool]]) -> None:
        """Count reads ``(name, hit, bytes, error, stored)``: hits and bytes, misses, corrupt values
        (logged once, deleted in the background) and values the full staging arena turned away."""
        bad = []
        for name, hit, nbytes, error, stored in reads:
            self._stats["hits" if hit else "misses"] += 1
            if hit:
                self._stats["bytes_read"] += nbytes
            elif error is not None:
                self._stats["checksum_errors"] += 1
                self._log_once("corrupt", "redis: invalid chunk under %s (%s); deleting it", name.decode(), error)
                bad.append(name)
            elif stored:
                self._stats["staging_full"] += 1
                self._log_once("staging", "redis: the staging arena is full; reads become misses")
        if bad:
            self._spawn(self._delete(bad))
        self._maybe_sample_usage()

    def _digest_of(self, name: bytes) -> bytes | None:
        if not name.startswith(self._prefix):
            return None
        try:
            digest = bytes.fromhex(name[len(self._prefix):].decode())
        except ValueError:
            return None
        return digest if len(digest) == KEY_BYTES else None

    # --- Redis calls ------------------------------------------------------------------
    def _deadline(self) -> AbstractAsyncContextManager[Any]:
        if self._closed:
            raise RuntimeError("redis tier used after close()")
        return asyncio.timeout(self.settings.timeout_s)

    def _connection(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = make_client(self.settings)
            self._loop = loop
        return self._client

    async def _pooled(self, read: Callable[[Any], Awaitable[T]]) -> T:
        """``read(conn)`` on a pooled connection, whose replies it parses itself; one retry on a
        fresh connection, as redis-py's own calls do (``read`` must start over on each call)."""
        pool = self._connection().connection_pool
        conn = await pool.get_connection()
        try:
            return await conn.retry.call_with_retry(lambda: read(conn), lambda _: conn.disconnect())
        finally:
            await pool.release(conn)

    async def _get_on(self, conn: Any, wants: list[Expected]) -> list[Reply]:
        await conn.send_packed_command(conn.pack_commands([("GET", self.redis_key(w.key)) for w in wants]))
        replies: list[Reply] = []

        async def read_all() -> list[Reply]:
            for want in wants:
                replies.append(await read_reply(conn._reader, want))
            return replies

        try:
            return await _read_or_drop(conn, "GET", read_all())
        except BaseException:
            for r in replies:
                if r.obj is not None:
                    r.obj.release()
            raise

    async def _get_cluster(self, wants: list[Expected]) -> list[Reply]:
        values = await self._run([("GET", self.redis_key(w.key)) for w in wants])
        return [decode_value(v if _is_stored(v) else None, w) for v, w in zip(values, wants)]

    async def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, or the exception it failed with; ``commands[i][1]`` is its key."""
        client = self._connection()
        if not self.settings.cluster:
            return await _pipeline(client, commands)
        await client.initialize()
        groups: dict[str, list[int]] = {}
        for i, cmd in enumerate(commands):
            groups.setdefault(client.get_node_from_key(cmd[1]).name, []).append(i)
        limit = self.settings.timeout_s * NODE_SHARE
        replies = await asyncio.gather(
            *(asyncio.wait_for(_pipeline(client, [commands[i] for i in idx]), limit) for idx in groups.values()),
            return_exceptions=True)
        out: list[Any] = [None] * len(commands)
        for (node, idx), reply in zip(groups.items(), replies):
            node_replies = [reply] * len(idx) if isinstance(reply, BaseException) else reply
            for i, r in zip(idx, node_replies):
                out[i] = r
            self._count_node_failures(node, node_replies)
        failures = [r for r in out if _failure(r)]
        if len(failures) == len(out):
            raise failures[0]
        return out

    def _count_node_failures(self, node: str, replies: Sequence[Any]) -> None:
        failures = [r for r in replies if _failure(r)]
        for r in failures:
            if not isinstance(r, Exception):  # a cancellation is not a node's failure
                raise r
        if failures:
            self._stats["node_errors"] += len(failures)
            self._log_once(f"node {node}", "redis: cluster node %s failed (%r); its keys are misses",
                           node, failures[0])

    async def _delete(self, names: list[bytes]) -> None:
        async with self._deadline():
            await self._run([("DEL", n) for n in names])

    def _maybe_sample_usage(self) -> None:
        now = time.monotonic()
        if now - self._usage_at >= USAGE_EVERY_S:
            self._usage_at = now
            self._spawn(self._sample_usage())

    async def _sample_usage(self) -> None:
        client = self._connection()
        async with self._deadline():
            if self.settings.cluster:
                infos = list((await client.info("memory", target_nodes=client.PRIMARIES)).values())
            else:
                infos = [await client.info("memory")]
        self._usage = (sum(int(i.get("used_memory", 0)) for i in infos),
                       sum(int(i.get("maxmemory", 0)) for i in infos))

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background; its failure is logged once per kind, never raised."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log_once("background", "redis: a background call failed: %r", task.exception())

    def _log_once(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)


def _failure(reply: Any) -> bool:
    """Whether a reply says a server could not answer (down, timed out, cluster down)."""
    from redis.exceptions import ClusterError, ResponseError

    return isinstance(reply, BaseException) and (not isinstance(reply, ResponseError)
                                                 or isinstance(reply, ClusterError))


def _is_stored(value: Any) -> bool:
    """Whether a GET reply is a stored value (bytes, or an error about its type), not a miss or failure."""
    return value is not None and not _failure(value)


def _raise_server_error(replies: Iterable[Any]) -> None:
    """Raise the first error reply about a command itself (e.g. OOM); node failures are counted."""
    for r in replies:
        if isinstance(r, BaseException) and not _failure(r):
            raise r


async def _read_or_drop(conn: Any, what: str, reading: Awaitable[T]) -> T:
    """``await reading`` (replies read from ``conn``'s stream); on any failure the connection,
    left mid-reply, is dropped, and a broken stream is raised as redis' ConnectionError."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        return await reading
    except BaseException as e:
        await conn.disconnect(nowait=True)
        if isinstance(e, (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)):
            raise RedisConnectionError(f"reading {what} replies: {e!r}") from e
        raise


async def _pipeline(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one pipeline; per-command errors come back as exceptions in the list."""
    async with client.pipeline(transaction=False) as pipe:
        for cmd in commands:
            pipe.execute_command(*cmd)
        return list(await pipe.execute(raise_on_error=False))
