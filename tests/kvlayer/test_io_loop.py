"""Tests of kvlayer/io_loop.py: results, errors, deadlines, late results, misuse, close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvlayer.io_loop import IOLoop


@pytest.fixture
def loop():
    io = IOLoop()
    yield io
    io.close()


async def _value(x: int) -> int:
    await asyncio.sleep(0)
    return x


def test_run_returns_the_result_on_another_thread(loop: IOLoop) -> None:
    async def where() -> str:
        return threading.current_thread().name

    assert loop.run(_value(7), timeout=5) == 7
    assert loop.run(where(), timeout=5) == "kvlayer-io"


def test_run_propagates_exceptions(loop: IOLoop) -> None:
    async def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        loop.run(boom(), timeout=5)


def test_deadline_cancels_the_coroutine_and_raises_timeout(loop: IOLoop) -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    start = time.monotonic()
    with pytest.raises(TimeoutError):
        loop.run(forever(), timeout=0.1)
    assert time.monotonic() - start < 1.0
    assert cancelled.wait(2)
    assert loop.run(_value(1), timeout=5) == 1  # the loop still works


def test_a_result_arriving_after_the_deadline_is_discarded(loop: IOLoop) -> None:
    discarded = []
    done = threading.Event()

    async def blocks_the_loop() -> str:
        time.sleep(0.3)  # cannot be cancelled: it finishes after the caller gave up
        return "late"

    def discard(value: str) -> None:
        discarded.append(value)
        done.set()

    with pytest.raises(TimeoutError):
        loop.run(blocks_the_loop(), timeout=0.05, discard=discard)
    assert done.wait(2)
    assert discarded == ["late"]


def test_submit_runs_in_the_background(loop: IOLoop) -> None:
    fut = loop.submit(_value(3))
    assert fut.result(5) == 3
    slow = loop.submit(asyncio.sleep(30))
    slow.cancel()
    assert loop.run(_value(4), timeout=5) == 4


def test_calls_from_the_loop_thread_raise(loop: IOLoop) -> None:
    async def inner() -> str:
        with pytest.raises(RuntimeError, match="loop thread"):
            loop.run(_value(1), timeout=1)
        with pytest.raises(RuntimeError, match="loop thread"):
            loop.submit(_value(1))
        with pytest.raises(RuntimeError, match="loop thread"):
            loop.close()
        return "ok"

    assert loop.run(inner(), timeout=5) == "ok"


def test_close_is_idempotent_cancels_pending_work_and_joins() -> None:
    io = IOLoop()
    cancelled = threading.Event()

    async def pending() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = io.submit(pending())
    time.sleep(0.05)
    io.close()
    io.close()
    assert cancelled.is_set()
    assert fut.cancelled()
    assert io.closed and io.loop.is_closed()
    with pytest.raises(RuntimeError, match="closed"):
        io.run(_value(1), timeout=1)
    with pytest.raises(RuntimeError, match="closed"):
        io.submit(_value(1))


def test_run_waiting_without_deadline_is_released_by_close() -> None:
    io = IOLoop()
    errors = []

    def waiter() -> None:
        try:
            io.run(asyncio.sleep(60))
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    io.close()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
