"""Tests of kvlayer/memory.py: arena capacity, churn without fragmentation, ref/pin counting."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvlayer.memory import Arena

SHAPE = (2, 2, 4, 2, 4)  # one 4-token chunk of float32: 512 bytes
SLOT = 512


def test_slots_and_capacity() -> None:
    arena = Arena(10 * SLOT + 100, SLOT - 10)  # the slot is rounded up to 64 bytes
    assert arena.slot_bytes == SLOT and arena.num_slots == 10 and arena.capacity_bytes == 10 * SLOT
    objs = [arena.allocate(SHAPE, torch.float32) for _ in range(10)]
    assert all(o is not None for o in objs) and arena.allocate(SHAPE, torch.float32) is None
    assert arena.buffer.numel() == arena.capacity_bytes  # allocated once, never grown
    for o in objs:
        o.release()
    assert arena.free_count == 10 and Arena(0, SLOT).allocate(SHAPE, torch.float32) is None


def test_objects_are_disjoint_views() -> None:
    arena = Arena(4 * SLOT, SLOT)
    objs = [arena.allocate(SHAPE, torch.float32) for _ in range(4)]
    for i, o in enumerate(objs):
        o.tensor.fill_(i)
    assert [o.tensor.unique().tolist() for o in objs] == [[0.0], [1.0], [2.0], [3.0]]
    assert objs[0].nbytes == SLOT and objs[0].num_tokens == 4
    assert bytes(objs[1].byte_view()[:4]) == torch.tensor([1.0]).numpy().tobytes()
    for o in objs:
        o.release()


def test_churn_of_ten_times_the_capacity_does_not_fragment() -> None:
    arena = Arena(16 * SLOT, SLOT)
    rng = random.Random(0)
    live = []
    for _ in range(160):
        if live and (rng.random() < 0.45 or arena.free_count == 0):
            live.pop(rng.randrange(len(live))).release()
        shape = (2, 2, rng.randint(1, 4), 2, 4)  # random sizes, all within a slot
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        obj = arena.allocate(shape, dtype)
        assert obj is not None
        live.append(obj)
        assert arena.used_count == len(live) <= arena.num_slots
    for o in live:
        o.release()
    full = [arena.allocate(SHAPE, torch.float32) for _ in range(16)]  # every slot usable again
    assert all(o is not None for o in full) and arena.free_count == 0
    for o in full:
        o.release()
    assert arena.free_count == 16


def test_too_big_and_bad_arenas_raise() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        Arena(4 * SLOT, SLOT).allocate((2, 2, 8, 2, 4), torch.float32)
    with pytest.raises(ValueError):
        Arena(SLOT, 0)
    with pytest.raises(ValueError):
        Arena(-1, SLOT)


def test_ref_and_pin_misuse_raise() -> None:
    arena = Arena(2 * SLOT, SLOT)
    obj = arena.allocate(SHAPE, torch.float32)
    assert obj.ref() is obj and obj.ref_count == 2
    obj.release()
    obj.release()
    assert arena.free_count == 2
    with pytest.raises(RuntimeError, match="released"):
        obj.release()
    with pytest.raises(RuntimeError, match="released"):
        obj.ref()
    other = arena.allocate(SHAPE, torch.float32)
    with pytest.raises(RuntimeError, match="unpin"):
        other.unpin()
    other.pin()
    with pytest.raises(RuntimeError, match="pinned"):
        other.release()


def test_counts_return_to_zero_under_threads() -> None:
    arena = Arena(4 * SLOT, SLOT)
    objs = [arena.allocate(SHAPE, torch.float32) for _ in range(4)]

    def work() -> None:
        for _ in range(2000):
            for o in objs:
                o.ref()
                o.pin()
                o.unpin()
                o.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(o.ref_count, o.pin_count) for o in objs] == [(1, 0)] * 4
    for o in objs:
        with o:
            pass  # the context manager releases the last reference
    assert [o.ref_count for o in objs] == [0] * 4 and arena.free_count == 4
