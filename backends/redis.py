"""The Redis tier: each chunk in two Redis keys, its serde header with the payload's last bytes
and the rest of its payload, so that Redis stores it without rounding it up to the next size class.

Enabled by ``redis_url``: ``redis://host:port/db``, ``rediss://`` (TLS; options such as
``ssl_ca_certs`` go in the URL's query), ``unix://``; ``user:password@`` for ACLs.
``redis_cluster: true`` talks to a Redis Cluster, whose nodes share the chunks by key. Chunk K
lives under ``<redis_key_prefix>:{<K hex>}`` (head) and ``<redis_key_prefix>:{<K hex>}:b`` (body),
one hash slot (the layout and why: ``backends/redis_pairs.py``), both written by one ``MSETNX``
(with their ``EXPIRE redis_ttl_s`` when > 0, in one ``MULTI`` but in cluster mode) and read
together: a reader gets the whole chunk or a miss, never half of one. A chunk that lost
one key (Redis evicts and expires keys one by one) is a miss counted in ``half_chunks``, and
its other key is deleted (by a read in the background, by ``contains_prefix`` before it
returns), so that the chunk can be written again.

Capacity is Redis's own (run it with ``maxmemory`` and ``allkeys-lru``): this tier evicts
nothing itself, ``pin``/``unpin`` pin nothing (they return 0), and chunks Redis evicts or
expires are not reported to the listener. ``usage()`` is the server's ``used_memory`` and
``maxmemory`` (summed over a cluster's primaries, all keys counted) as last sampled, at most
every ``USAGE_EVERY_S``, by the coroutine calls.

Faults: values that are not a valid chunk for their key (garbage, truncated, another key's, a
flipped bit, in either key) are a miss counted in ``checksum_errors``, and both keys are
deleted. Every call is bounded by ``tier_timeout_ms`` (socket and connect timeouts and an
overall deadline); connection errors and timeouts raise, and the next call reconnects by
itself. In cluster mode a batch is split into one pipeline per node: a node that fails makes
its own keys misses (``node_errors``) while the others answer; the call raises only if every
node it needed failed.

Throughput: a value is never copied whole on the way out or in. The body is a view of the
chunk's tensor (or its lz4 frame), which ``backends/redis_clients.py`` writes to the socket from
that memory: Python 3.11's ``StreamWriter.writelines`` would join every piece into one new
buffer and its transport copy that twice more (0.3 GiB/s for 6 MiB values here, 2-3 GiB/s
piecewise). Raw chunks are read by the tier's one fast path (``backends/redis_reads.py``) over
connections of its own (``backends/redis_wire.py``), without redis-py's stream reader and its
copies: ``GET`` of the heads and ``STRLEN`` of the bodies (seen together, as by ``MGET``), then
``GETRANGE`` of the bodies by layer group, each range received straight into its destination (a
staging object for ``get_many``, the caller's chunk for ``read_layers``) and hashed as it lands
(``backends/byte_reads.py``). Compressed or quantized tiers and cluster mode (whose clients take
no connection class: bodies are joined once) read whole chunks with redis-py's ``MGET``,
checked by ``redis_pairs.decode_pair``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from kvlayer import serde
from kvlayer.backends.byte_reads import ChunkRead
from kvlayer.backends.redis_clients import (
    PiecewiseValue,
    RedisSettings,
    is_failure,
    make_client,
    pipeline,
    raise_server_error,
    sync_client,
)
from kvlayer.backends.redis_pairs import (
    MISS,
    ChunkNames,
    Expected,
    HalfChunk,
    Reply,
    chunk_names,
    decode_pair,
    digest_of,
    head_pattern,
    msetnx_reply,
    split,
    write_commands,
)
from kvlayer.backends.redis_reads import ValueRead, read_values
from kvlayer.backends.redis_wire import Wire, WirePool
from kvlayer.keys import ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj, release_all
from kvlayer.storage import BackendContext, StorageBackend, check_batch

COUNTERS = ("hits", "misses", "checksum_errors", "half_chunks", "staging_full", "node_errors", "bytes_read",
            "bytes_written", "puts", "removed")
"""What ``stats()`` counts (``half_chunks``: chunks found with one of their two keys, the other
evicted or expired by Redis; ``node_errors``: keys lost to a failing node in cluster mode)."""

USAGE_EVERY_S = 5.0
NODE_SHARE = 0.8
"""In cluster mode each node's pipeline gets this share of the deadline, so the others' answers
arrive before the call's deadline when one node hangs."""


class RedisBackend(StorageBackend):
    """Chunks as pairs of Redis values (header + payload tail, payload body), read into ``staging``.

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
        self._wires: WirePool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefix = settings.prefix.encode() + b":"
        self._stats: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._usage = (0, 0)
        self._usage_at = float("-inf")
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def create(cls, ctx: BackendContext) -> RedisBackend | None:
        """The tier from its settings (``ctx.tier_settings``: ``url``, ``cluster``, ``ttl_s``,
        ``key_prefix``, declared in ``backends/settings.py``), or None when ``url`` is unset. No I/O
        (the client connects lazily)."""
        own, cfg = ctx.tier_settings(cls.name), ctx.config
        if not own["url"]:
            return None
        settings = RedisSettings(own["url"], own["cluster"], own["ttl_s"], own["key_prefix"],
                                 cfg.compression, cfg.tier_timeout_ms / 1000, cfg.storage_quantization)
        return cls(settings, ctx.layout, ctx.staging)

    def redis_keys(self, key: ChunkKey) -> ChunkNames:
        """The Redis keys of ``key``'s chunk: ``<prefix>:{<key hex>}`` and ``<prefix>:{<key hex>}:b``."""
        return chunk_names(self._prefix, key)

    # --- the StorageBackend interface -------------------------------------------------
    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading chunks have both keys; a chunk found with one key loses it (awaited,
        so that a write right after this call finds neither key and can store the chunk)."""
        if not keys:
            return 0
        names = [self.redis_keys(k) for k in keys]
        async with self._deadline():
            replies = await self._run([("EXISTS", *n) for n in names])
            halves = [n for n, r in zip(names, replies) if r == 1]
            if halves:
                self._stats["half_chunks"] += len(halves)
                await self._run([("DEL", *n) for n in halves])
        n = 0
        while n < len(keys) and replies[n] == 2:
            n += 1
        return n

    @property
    def ranged_reads(self) -> bool:
        """Whether chunks are read by the fast path (``backends/redis_reads.py``): in a tier of raw
        chunks, not in cluster mode (else whole chunks are read through redis-py)."""
        settings = self.settings
        return not settings.cluster and settings.compression == "none" and settings.quantization == "none"

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        if not keys:
            return []
        shapes = [self._layout.chunk_shape(k.num_tokens, len(k.layers)) for k in keys]
        if not self.ranged_reads:
            wants = [Expected(k, shape, self._layout.dtype, self._staging, self.settings.quantization)
                     for k, shape in zip(keys, shapes)]
            async with self._deadline():
                replies = await self._get_parsed(wants)
            # No await from here on: the objects in the replies cannot leak to a cancellation.
            self._tally([(self.redis_keys(k), r.obj is not None, r.nbytes, r.error, r.stored)
                         for k, r in zip(keys, replies)])
            return [r.obj for r in replies]
        whole = [(0, max(shape[0] for shape in shapes))]  # one group: nobody waits for early layers
        async with self._deadline():
            values = await self._read_ranged(keys, shapes, [None] * len(keys), whole, lambda g: None)
        hits = [v.chunk.verified() for v in values]
        release_all(v.out for v, hit in zip(values, hits) if v.out is not None and not hit)
        self._tally([(v.names, hit, v.nbytes, v.chunk.error, v.stored) for v, hit in zip(values, hits)])
        return [v.out if hit else None for v, hit in zip(values, hits)]

    async def read_layers(self, keys: Sequence[ChunkKey], outs: Sequence[MemoryObj],
                          groups: Sequence[tuple[int, int]], on_group: Callable[[int], None]) -> list[bool]:
        """``StorageBackend.read_layers`` with pipelined ``GETRANGE``s of the bodies by layer group
        (``backends/redis_reads.py``); where ``ranged_reads`` is false, whole chunks through redis-py."""
        if not keys or not self.ranged_reads:
            return await super().read_layers(keys, outs, groups, on_group)
        async with self._deadline():
            values = await self._read_ranged(keys, [o.shape for o in outs], outs, groups, on_group)
        flags = [v.chunk.verified() for v in values]
        # Not "stored": a chunk read into the caller's ``outs`` never meets a full staging arena.
        self._tally([(v.names, ok, v.nbytes, v.chunk.error, False) for v, ok in zip(values, flags)])
        return flags

    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        """Write each chunk neither of whose keys is present (``MSETNX``); ValueError (before
        anything is written) unless each chunk fits its key (``check_batch``).

        In cluster mode, chunks bound for a failing node are dropped (``node_errors``); a
        server error reply (e.g. OOM) raises after the other chunks are written.
        """
        check_batch(keys, chunks, self._layout)
        if not keys:
            return
        pairs = [self._encode(k, c) for k, c in zip(keys, chunks)]
        # A cluster pipeline can neither route MULTI (there the EXPIREs follow MSETNX in the same
        # pipeline) nor send a value in pieces (there each body is joined once).
        cluster = self.settings.cluster
        multi = self.settings.ttl_s > 0 and not cluster
        commands = [write_commands(self.redis_keys(k), head, body.joined() if cluster else body, self.settings.ttl_s,
                                   multi) for k, (head, body) in zip(keys, pairs)]
        async with self._deadline():
            replies = await self._run([c for cmds in commands for c in cmds])
        step = len(commands[0])
        written = [msetnx_reply(replies[i : i + step], multi) for i in range(0, len(replies), step)]
        new = [i for i, r in enumerate(written) if r == 1]
        self._stats["puts"] += len(new)
        self._stats["bytes_written"] += sum(len(pairs[i][0]) + pairs[i][1].nbytes for i in new)
        self._admitted([keys[i].digest for i in new])
        self._maybe_sample_usage()
        raise_server_error(written)

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        async with self._deadline():
            replies = await self._run([("DEL", *self.redis_keys(k)) for k in keys])
        gone = [k.digest for k, r in zip(keys, replies) if isinstance(r, int) and r > 0]
        self._stats["removed"] += len(gone)
        self._evicted(gone)
        return len(gone)

    def usage(self) -> tuple[int, int]:
        return self._usage

    def keys(self) -> list[bytes]:
        """Digests of every chunk under the prefix (one per head), by a blocking ``SCAN``: call it off the I/O loop."""
        client = sync_client(self.settings)
        try:
            names = client.scan_iter(match=head_pattern(self._prefix), count=1000)
            return [d for d in (digest_of(self._prefix, n) for n in names) if d is not None]
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
            if self._wires is not None:
                self._wires.close()
            await client.aclose()

    # --- encoding and decoding --------------------------------------------------------
    def _encode(self, key: ChunkKey, chunk: MemoryObj) -> tuple[bytes, PiecewiseValue]:
        """The head and body values; the body is a view of the chunk (or of its encoded form)."""
        tensor = chunk.tensor if chunk.tensor.device.type == "cpu" else chunk.tensor.cpu()
        head, body = split(*serde.encode_chunk(key, tensor, self.settings.compression, self.settings.quantization))
        return head, PiecewiseValue((body,))

    def _tally(self, reads: Sequence[tuple[ChunkNames, bool, int, Exception | None, bool]]) -> None:
        """Count reads ``(names, hit, bytes, error, stored)``: hits and bytes, misses, corrupt values
        and half chunks (logged once, both keys deleted in the background) and values the full
        staging arena turned away."""
        bad = []
        for names, hit, nbytes, error, stored in reads:
            self._stats["hits" if hit else "misses"] += 1
            if hit:
                self._stats["bytes_read"] += nbytes
            elif error is not None:
                kind = "half_chunks" if isinstance(error, HalfChunk) else "checksum_errors"
                self._stats[kind] += 1
                self._log_fault(kind, "invalid chunk %s (%s); deleting its keys", names.head.decode(), error)
                bad.append(names)
            elif stored:
                self._stats["staging_full"] += 1
                self._log_fault("staging", "the staging arena is full; reads become misses")
        if bad:
            self._spawn(self._delete(bad))
        self._maybe_sample_usage()

    # --- Redis calls ------------------------------------------------------------------
    def _deadline(self) -> AbstractAsyncContextManager[Any]:
        if self._closed:
            raise RuntimeError("redis tier used after close()")
        return asyncio.timeout(self.settings.timeout_s)

    def _connection(self) -> Any:
        """This event loop's redis-py client (and ``_wires``, its pool of the tier's own connections)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = make_client(self.settings)
            self._wires = WirePool(self.settings.url)
            self._loop = loop
        return self._client

    async def _read_ranged(self, keys: Sequence[ChunkKey], shapes: Sequence[tuple[int, ...]],
                           outs: Sequence[MemoryObj | None], groups: Sequence[tuple[int, int]],
                           on_group: Callable[[int], None]) -> list[ValueRead]:
        """Each chunk ``keys[i]`` (of ``shapes[i]``) read into ``outs[i]`` (None: a staging object,
        then owned by the caller) on one of the tier's own connections (``backends/redis_wire.py``);
        a failure releases the staging objects and raises."""
        async def attempt(wire: Wire) -> list[ValueRead]:  # a retry starts over
            values = [ValueRead(self.redis_keys(k), ChunkRead(k, shape, self._layout.dtype), out,
                                self._staging if out is None else None)
                      for k, shape, out in zip(keys, shapes, outs, strict=True)]
            try:
                await read_values(wire, values, groups, on_group)
            except BaseException:
                release_all(v.out for v in values if v.staging is not None and v.out is not None)
                raise
            return values

        self._connection()
        assert self._wires is not None
        return await self._wires.run(attempt)

    async def _get_parsed(self, wants: list[Expected]) -> list[Reply]:
        """Whole chunks through redis-py's reply parser (where ``ranged_reads`` is false)."""
        values = await self._run([("MGET", *self.redis_keys(w.key)) for w in wants])
        return [decode_pair(*v, w) if isinstance(v, list) else _error_reply(v) for v, w in zip(values, wants)]

    async def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, or the exception it failed with; ``commands[i][1]`` is its key."""
        client = self._connection()
        if not self.settings.cluster:
            return await pipeline(client, commands)
        await client.initialize()
        groups: dict[str, list[int]] = {}
        for i, cmd in enumerate(commands):
            groups.setdefault(client.get_node_from_key(cmd[1]).name, []).append(i)
        limit = self.settings.timeout_s * NODE_SHARE
        replies = await asyncio.gather(
            *(asyncio.wait_for(pipeline(client, [commands[i] for i in idx]), limit) for idx in groups.values()),
            return_exceptions=True)
        out: list[Any] = [None] * len(commands)
        for (node, idx), reply in zip(groups.items(), replies):
            node_replies = [reply] * len(idx) if isinstance(reply, BaseException) else reply
            for i, r in zip(idx, node_replies):
                out[i] = r
            self._count_node_failures(node, node_replies)
        failures = [r for r in out if is_failure(r)]
        if len(failures) == len(out):
            raise failures[0]
        return out

    def _count_node_failures(self, node: str, replies: Sequence[Any]) -> None:
        failures = [r for r in replies if is_failure(r)]
        for r in failures:
            if not isinstance(r, Exception):  # a cancellation is not a node's failure
                raise r
        if failures:
            self._stats["node_errors"] += len(failures)
            self._log_fault(f"node {node}", "cluster node %s failed (%r); its keys are misses",
                            node, failures[0])

    async def _delete(self, names: list[ChunkNames]) -> None:
        async with self._deadline():
            await self._run([("DEL", *n) for n in names])

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
            self._log_fault("background", "a background call failed: %r", task.exception())


def _error_reply(reply: Any) -> Reply:
    """The read of a chunk whose MGET failed: a miss for a server that could not answer, else
    (an error reply about the keys, e.g. NOPERM) an error."""
    return MISS if is_failure(reply) else Reply(None, True, serde.ChunkFormatError(f"error reply: {reply!r:.80}"))
