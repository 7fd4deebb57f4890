"""``IOLoop``: kvlayer's one background asyncio event loop, in its own daemon thread.

The backends' I/O runs here (docs/architecture.md section 6); the engine thread hands it
coroutines with ``run`` (wait for the result, with a deadline) or ``submit`` (background
work). Neither may be called from the loop thread itself: waiting there would deadlock.

Usage::

    loop = IOLoop()
    n = loop.run(backend.contains_prefix(keys), timeout=2.0)
    loop.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

BACKGROUND_NICE = 19
"""How much lower the CPU priority of kvlayer's background threads is (Linux per-thread nice): on
a busy CPU the engine's own threads come first, and background work takes the time they leave."""

_background: contextvars.ContextVar[bool] = contextvars.ContextVar("kvlayer_background", default=False)
_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_pool_lock = threading.Lock()


def lower_priority() -> None:
    """Lower the calling thread's CPU priority by ``BACKGROUND_NICE`` (where the OS allows it)."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: full priority
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Within it, the I/O this thread hands the loop (``IOLoop.run``/``submit``: the coroutines
    inherit the caller's context) is background work: the blocking part a tier runs on threads
    (file reads) goes to ``blocking_executor``'s lower-priority threads."""
    token = _background.set(True)
    try:
        yield
    finally:
        _background.reset(token)


def blocking_executor() -> concurrent.futures.Executor | None:
    """Where a tier's coroutine runs its blocking calls (``run_in_executor``): a shared pool of
    lower-priority threads for background work (``background``), else None (the loop's default)."""
    if not _background.get():
        return None
    with _pool_lock:
        if not _pool:
            _pool.append(concurrent.futures.ThreadPoolExecutor(
                max(4, os.cpu_count() or 1), thread_name_prefix="kvlayer-background", initializer=lower_priority))
        return _pool[0]


class _Handoff:
    """Who gets a coroutine's result: the waiting caller, or ``discard`` once the caller gave up."""

    __slots__ = ("lock", "abandoned", "delivered", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.delivered = False
        self.value: Any = None


class IOLoop:
    """A running event loop in a daemon thread, from construction until ``close()``."""

    def __init__(self, name: str = "kvlayer-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The underlying loop (to create loop-bound objects; schedule work with run/submit)."""
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None,
            discard: Callable[[T], None] | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exceptions propagate).

        After ``timeout`` seconds the coroutine is cancelled and ``TimeoutError`` raised. If it
        finishes anyway after the caller gave up, ``discard(result)`` runs on the loop thread,
        so results that own resources (memory object references) are not leaked.
        Raises ``RuntimeError`` if called on the loop thread or once the loop is closed.
        """
        self._check_caller("run", coro)
        hand = _Handoff()
        try:
            fut = self._schedule(self._guard(coro, hand, discard))
        except RuntimeError:
            coro.close()
            raise
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            with hand.lock:
                if hand.delivered:
                    return hand.value
                hand.abandoned = True
            fut.cancel()
            raise TimeoutError(f"I/O loop call did not finish within {timeout} s") from None
        except concurrent.futures.CancelledError:
            raise RuntimeError("the I/O loop closed before the call finished") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; the returned future completes with its result.

        Cancelling the future cancels the coroutine. Raises ``RuntimeError`` if called on the
        loop thread or once the loop is closed.
        """
        self._check_caller("submit", coro)
        return self._schedule(coro)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel pending work, stop the loop and join its thread (idempotent).

        Waits up to ``timeout`` seconds for the thread; a coroutine that blocks the loop
        longer is left behind in the daemon thread (with one log line).
        """
        if self.in_loop_thread():
            raise RuntimeError("IOLoop.close() called from the loop thread")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Queued after every callback submitted before it, so every task exists by then.
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kvlayer I/O loop thread did not stop within %.1f s", timeout)

    # --- internals ----------------------------------------------------------------------
    def _check_caller(self, what: str, coro: Coroutine[Any, Any, Any]) -> None:
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"IOLoop.{what}() called from the loop thread (it would deadlock)")

    def _schedule(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("the I/O loop is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @staticmethod
    async def _guard(coro: Coroutine[Any, Any, T], hand: _Handoff,
                     discard: Callable[[T], None] | None) -> T:
        value = await coro
        with hand.lock:
            if not hand.abandoned:
                hand.delivered, hand.value = True, value
                return value
        if discard is not None:
            try:
                discard(value)
            except Exception:
                log.exception("discarding a late I/O loop result failed")
        return value

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()
