"""``AsyncEngine``: one engine loop, on its own thread, that batches every connection's requests.

The HTTP handlers run on the asyncio loop; the engine (``LLMEngine``) is only ever touched by
the engine thread. Handlers hand it commands (add, abort) through a queue; the thread applies
them between steps, runs ``step()`` while anything is unfinished and delivers each output to
its request's ``asyncio.Queue`` with ``call_soon_threadsafe``. There is no lock per request:
the scheduler batches whatever is queued (continuous batching, chunked prefill).

Contracts:
- ``submit`` returns once the engine has taken the request, so a bad prompt (``ValueError``
  from ``add_request``) is raised before any answer starts; past ``max_waiting`` queued
  requests ``Overloaded`` is raised at once. The ``RequestHandle`` yields the request's
  outputs in order. ``abort()`` (a disconnect, a stop string) stops it between two steps:
  its blocks go back and the connector forgets it.
- ``shutdown`` stops taking requests (``ShuttingDown``), lets the running ones finish, then
  closes the engine on its own thread (kvlayer's connector flushes its writes there).
- A request the engine fails alone (its sampling failed: ``LLMEngine`` finishes it with reason
  "error" and the others in its step go on) arrives as its final output, like any other; the
  server answers it 500 or with an error event in its stream (serving/generation.py).
- A step that raises (the model's forward pass, shared by the step's requests) fails every
  live request with ``EngineError`` (their blocks are freed) and the loop goes on; the server
  answers those requests 500 and keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvlayer.engine.llm import LLMEngine, PromptType
from kvlayer.engine.outputs import RequestOutput
from kvlayer.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """More than ``max_waiting`` requests are queued: try again later (HTTP 503)."""


class ShuttingDown(Exception):
    """The server is draining: no new requests (HTTP 503)."""


class EngineError(Exception):
    """The engine failed while running this request (HTTP 500; the server keeps serving)."""


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[RequestOutput | Exception]
    loop: asyncio.AbstractEventLoop

    def put(self, item: RequestOutput | Exception) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Owns ``engine`` and the thread that steps it. Call ``start()`` once, ``shutdown()`` once."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        if max_waiting <= 0:
            raise ValueError(f"max_waiting must be positive, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._cv = threading.Condition()
        self._commands: list[tuple[Any, ...]] = []
        self._pending_adds = 0
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._accepting = True
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvlayer-engine-loop", daemon=True)
        self._closed = threading.Event()

    # ----- the asyncio side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running and taking requests."""
        return self._thread.is_alive() and self._accepting

    @property
    def num_queued(self) -> int:
        """Requests submitted and not yet scheduled (read from any thread; approximate)."""
        return self._pending_adds + self.engine.num_waiting

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def submit(self, prompt: PromptType, params: SamplingParams, request_id: str) -> RequestHandle:
        """Queue one request and wait until the engine took it; the handle streams its outputs.

        Raises ``ShuttingDown``, ``Overloaded``, ``ValueError`` (a bad prompt) or ``EngineError``.
        Cancelled while waiting, it aborts the request.
        """
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
        if self.num_queued >= self.max_waiting:
            raise Overloaded(f"{self.num_queued} requests are already waiting (--max-waiting {self.max_waiting})")
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop)
        added: asyncio.Future[None] = loop.create_future()
        self._submit(("add", request_id, prompt, params, stream, added), adds=1)
        try:
            await added
        except asyncio.CancelledError:
            self._submit(("abort", request_id))
            raise
        return RequestHandle(self, request_id, stream)

    async def shutdown(self) -> None:
        """Drain (see the module docstring) and wait until the engine is closed."""
        self._accepting = False
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._closed.wait)

    async def flush_kv(self, timeout: float) -> bool:
        """Wait (off the loop) until kvlayer has written every chunk saved so far; False
        without kvlayer or when ``timeout`` passed first."""
        flush = getattr(self.engine.connector, "flush_writes", None)
        if flush is None:
            return False
        return await asyncio.get_running_loop().run_in_executor(None, flush, timeout)

    def close_unstarted(self) -> None:
        """Close the engine when the loop never started (a server that failed to start)."""
        if not self._thread.is_alive() and not self._closed.is_set():
            self.engine.close()
            self._closed.set()

    def _submit(self, command: tuple[Any, ...], adds: int = 0) -> None:
        with self._cv:
            self._commands.append(command)
            self._pending_adds += adds
            self._cv.notify()

    # ----- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    if self._stopping and not commands and not self.engine.has_unfinished_requests():
                        break
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
        finally:
            self._fail_all(ShuttingDown("the server is shutting down"))
            try:
                self.engine.close()
            except Exception:
                log.exception("kvlayer serve: closing the engine failed")
            self._closed.set()

    def _apply(self, command: tuple[Any, ...]) -> None:
        if command[0] == "abort":
            rid = command[1]
            if self._streams.pop(rid, None) is not None:
                self.engine.abort_request(rid)
            return
        _, rid, prompt, params, stream, added = command
        with self._cv:
            self._pending_adds -= 1
        try:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self.engine.add_request(prompt, params, request_id=rid)
        except Exception as e:  # ValueError: a bad prompt; anything else is the engine's fault
            error = e if isinstance(e, ValueError | ShuttingDown) else EngineError(f"adding the request failed: {e}")
            stream.loop.call_soon_threadsafe(_set_exception, added, error)
            return
        self._streams[rid] = stream
        stream.loop.call_soon_threadsafe(_set_result, added)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("kvlayer serve: an engine step failed; failing its requests")
            self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("kvlayer serve: aborting %s failed", rid)
        self._streams.clear()


class RequestHandle:
    """One submitted request: iterate ``outputs()``; ``abort()`` if you leave before it finished."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._owner = owner
        self._stream = stream
        self.finished = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Its outputs in order, ending after the finished one; raises ``EngineError`` or
        ``ShuttingDown`` if the engine gave up on it."""
        while not self.finished:
            item = await self._stream.queue.get()
            if isinstance(item, Exception):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        """Stop it between two steps (nothing happens if it already finished); idempotent."""
        if not self.finished:
            self.finished = True
            self._owner._submit(("abort", self.request_id))


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
