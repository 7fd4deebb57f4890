"""The lookup channel: a scheduler process asks the process holding the tiers (docs/vllm.md, "Two processes").

An engine that runs its scheduler apart from its model (vLLM: the engine-core process and the
worker processes) keeps kvlayer's tiers (its CPU memory among them) in the worker. The worker
answers the scheduler's
"how much of this prompt do you hold, and where" over a Unix socket, one per worker rank, at a
path both sides derive from vLLM's engine id (``socket_path``).

It asks the step layer's one lookup (``KVCacheEngine.lookup``), window-aware, with the request's
id (the worker keeps its keys for the request's loads and saves), how many tokens vLLM holds
already and the most it may load.

Wire format (little-endian, no pickle): a request is ``u32 length`` + ``u16 id length`` + the
request id + ``u16 salt length`` + the salt (UTF-8; empty for none) + ``u32 start`` + ``u32
limit`` + the token ids as int32; the answer is ``u32 found tokens`` + ``u32 n`` + ``n`` bytes,
the tier index of each chunk object to read. A client that cannot reach the
worker, gets no answer within its timeout or a garbled one (more tokens than it asked about,
or more chunks than ``MAX_GROUPS`` per token), or has a request the format cannot carry,
answers a miss: the scheduler never waits long and never raises for the channel.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvlayer.health import LogThrottle

log = logging.getLogger(__name__)

Answer = tuple[int, tuple[int, ...]]
"""Found tokens, and the tier index of each found chunk."""
MISS: Answer = (0, ())
MAX_REQUEST_BYTES = 64 << 20
"""The largest request a server reads (16M tokens); a longer one closes the connection."""
RETRY_S = 1.0
"""How long a client waits after a failure before it tries to connect again."""
MAX_GROUPS = 64
"""An answer names at most this many chunk objects per token asked about (one per layer group)."""


def socket_path(engine_id: str, rank: int) -> str:
    """The socket of worker ``rank`` of the vLLM engine ``engine_id`` (short enough for AF_UNIX)."""
    tag = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"kvlayer-{tag}-{rank}.sock")


def _read_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ``ConnectionError`` if it closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the lookup channel")
        got += k
    return bytes(buf)


@dataclass(frozen=True, slots=True)
class Query:
    """One lookup: may request ``request_id`` (its tokens ``token_ids`` under ``salt``), holding
    its first ``start`` tokens, load up to ``limit`` tokens?"""

    token_ids: list[int]
    salt: str | None
    request_id: str = ""
    start: int = 0
    limit: int = 0


def encode_request(token_ids: Sequence[int], salt: str | None, request_id: str = "", start: int = 0,
                   limit: int | None = None) -> bytes:
    """The request bytes (``limit`` None: every token); ``ValueError`` for ids outside int32 or
    an id or salt over 65535 bytes."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in [0, 2**31)")
    rid, salt_bytes = request_id.encode(), (salt or "").encode()
    if max(len(rid), len(salt_bytes)) > 0xFFFF:
        raise ValueError("a request id or salt over 65535 bytes")
    limit = len(token_ids) if limit is None else limit
    body = b"".join([struct.pack("<H", len(rid)), rid, struct.pack("<H", len(salt_bytes)), salt_bytes,
                     struct.pack("<II", max(0, start), max(0, limit)), tokens.astype("<i4").tobytes()])
    return struct.pack("<I", len(body)) + body


def decode_request(body: bytes) -> Query:
    """The ``Query`` of a request body; ``ValueError`` if it is malformed."""
    try:
        (n_rid,) = struct.unpack_from("<H", body)
        rid = body[2 : 2 + n_rid].decode()
        (n_salt,) = struct.unpack_from("<H", body, 2 + n_rid)
        at = 4 + n_rid + n_salt
        salt = body[4 + n_rid : at].decode()
        start, limit = struct.unpack_from("<II", body, at)
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"a malformed lookup request ({e})") from None
    rest = len(body) - at - 8
    if rest < 0 or rest % 4:
        raise ValueError(f"a lookup request of {len(body)} bytes does not hold whole token ids")
    tokens = np.frombuffer(body, dtype="<i4", offset=at + 8).tolist()
    return Query(tokens, salt or None, rid, start, min(limit, len(tokens)))


class LookupServer:
    """Answers lookups at ``path`` with ``answer(query)`` until ``close``.

    One daemon thread accepts connections and one serves each; ``answer`` is called from those
    threads (it must be thread-safe) and an exception in it answers a miss (logged)."""

    def __init__(self, path: str, answer: Callable[[Query], Answer]) -> None:
        self.path = path
        self._answer = answer
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a previous engine's, left by a crash
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._accept, name="kvlayer-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvlayer-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_requests(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_requests(self, conn: socket.socket) -> None:
        """Answer ``conn``'s requests until it closes, errs or the server closes."""
        while not self._closed.is_set():
            try:
                (size,) = struct.unpack("<I", _read_exact(conn, 4))
                if size > MAX_REQUEST_BYTES:
                    log.warning("kvlayer lookup: a %d-byte request is over the limit; closing it", size)
                    return
                query = decode_request(_read_exact(conn, size))
            except (ConnectionError, OSError):
                return
            except ValueError as e:
                log.warning("kvlayer lookup: %s; closing the connection", e)
                return
            try:
                found, sources = self._answer(query)
            except Exception:
                log.exception("kvlayer lookup: answering failed; a miss")
                found, sources = MISS
            try:
                conn.sendall(struct.pack("<II", found, len(sources)) + bytes(sources))
            except OSError:
                return

    def close(self) -> None:
        """Stop serving (open connections included) and remove the socket file (idempotent)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            conns = list(self._conns)
        for sock in [self._sock, *conns]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class LookupClient:
    """Asks the worker at ``path``; every failure is a miss (logged, throttled), and after one
    the client waits ``RETRY_S`` before it connects again. Use from one thread."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._throttle = LogThrottle(60.0)

    def lookup(self, token_ids: Sequence[int], salt: str | None, *, request_id: str = "", start: int = 0,
               limit: int | None = None) -> Answer:
        """How many leading tokens of ``token_ids`` (at most ``limit``) the worker can load for a
        request holding ``start`` already, and the tier of each chunk object to read;
        ``MISS`` when the worker cannot be asked."""
        sent = self.send(token_ids, salt, request_id=request_id, start=start, limit=limit)
        return self.receive(len(token_ids)) if sent else MISS

    def send(self, token_ids: Sequence[int], salt: str | None, *, request_id: str = "", start: int = 0,
             limit: int | None = None) -> bool:
        """``lookup``'s request alone (``receive`` reads its answer), so several workers can be
        asked at once; False, with nothing to receive, when the worker cannot be asked."""
        if self._sock is None and time.monotonic() < self._retry_at:
            return False
        try:
            request = encode_request(token_ids, salt, request_id, start, limit)
        except (ValueError, OverflowError) as e:  # not expressible on the wire: an id past int32, a lone surrogate
            if self._throttle.allow():
                log.warning("kvlayer: a lookup the channel cannot carry (%s); a miss", e)
            return False
        try:
            self._connected().sendall(request)
        except OSError as e:
            self._fail(e)
            return False
        return True

    def receive(self, asked: int) -> Answer:
        """The answer to the request ``send`` sent about ``asked`` tokens; ``MISS`` on a failure
        or a garbled answer."""
        try:
            if self._sock is None:
                raise ConnectionError("no request was sent")
            found, n = struct.unpack("<II", _read_exact(self._sock, 8))
            if found > asked or n > asked * MAX_GROUPS:  # at most a chunk per token and group
                raise ConnectionError(f"a garbled answer ({found} tokens, {n} chunks) to {asked} tokens")
            return found, tuple(_read_exact(self._sock, n))
        except (OSError, ConnectionError) as e:
            self._fail(e)
            return MISS

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _fail(self, error: Exception) -> None:
        if self._throttle.allow():
            log.warning("kvlayer: the lookup channel %s failed (%s); a miss, retrying in %.0f s",
                        self.path, error, RETRY_S)
        self.close()
        self._retry_at = time.monotonic() + RETRY_S

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
