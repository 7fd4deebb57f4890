"""Tests of kvlayer/copy_runs.py: chunks an arena allocated one after another form runs that a
``CopyPlan`` scatters as one op per layer, bit for bit as a token-by-token copy; anything that
breaks a run (another stride, another storage, another shape) falls back to one op per piece."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvlayer import transfer
from kvlayer.copy_runs import Run, find_runs
from kvlayer.memory import Arena
from tests.kvlayer.test_transfer import BLOCK_SIZE, LAYERS, bits, same, scattered

HEADS, DIM, TOKENS = 4, 16, 32
SHAPE = (LAYERS, 2, TOKENS, HEADS, DIM)


class CopyOps(TorchFunctionMode):
    """Counts the indexed copies torch is asked for: ``index_copy_`` and indexed assignments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("index_copy_", "__setitem__"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def arena_chunks(count: int, seed: int, arena: Arena | None = None) -> tuple[Arena, list]:
    arena = arena or Arena(16 * 4 * LAYERS * 2 * TOKENS * HEADS * DIM, 4 * LAYERS * 2 * TOKENS * HEADS * DIM)
    objs = [arena.allocate(SHAPE, torch.float32) for _ in range(count)]
    for i, obj in enumerate(objs):
        obj.tensor.copy_(bits(torch.float32, SHAPE, seed + i))
    return arena, objs


def test_the_arena_hands_out_its_lowest_free_slot_first() -> None:
    arena, objs = arena_chunks(5, seed=1)
    assert [o.slot for o in objs] == [0, 1, 2, 3, 4]
    objs[3].release()
    objs[1].release()
    again = [arena.allocate(SHAPE, torch.float32) for _ in range(3)]
    assert [o.slot for o in again] == [1, 3, 5]


def test_runs_follow_one_stride_in_one_storage_and_break_elsewhere() -> None:
    arena, objs = arena_chunks(6, seed=2)
    objs[2].release()  # slots 0 1 _ 3 4 5
    held = [objs[i].tensor for i in (0, 1, 3, 4, 5)]
    slots = [torch.arange(TOKENS) + TOKENS * i for i in range(5)]
    ids = [tuple(range(LAYERS))] * 5
    step = arena.slot_bytes
    assert find_runs(held, slots, ids) == [Run(0, 2, step), Run(2, 3, step)]
    other = bits(torch.float32, SHAPE, seed=9)  # another storage
    assert find_runs([held[0], other, held[1]], slots[:3], ids[:3]) == []
    sliced = [held[0], held[1][:, :, 1:]]  # another shape: a token slice
    assert find_runs(sliced, [slots[0], slots[1][1:]], ids[:2]) == []
    assert find_runs(held[:2], slots[:2], [ids[0], (0,)]) == [], "other layers"
    assert find_runs(held[:2][::-1], slots[:2], ids[:2]) == [], "downwards: no strided view"


@pytest.mark.parametrize("threads", [1, 2])
def test_a_plan_scatters_a_run_as_one_op_per_layer_to_the_same_bytes(threads: int) -> None:
    """A partial first chunk (a token slice) alone, then four whole chunks in one run, then a chunk
    from elsewhere: the cache equals a token-by-token copy, whichever layer order, no copy threads."""
    _, objs = arena_chunks(5, seed=3)
    outsider = bits(torch.float32, SHAPE, seed=8)
    blocks = 7 * TOKENS // BLOCK_SIZE + 2
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(4)).tolist()
    slots = transfer.slot_mapping(table, BLOCK_SIZE, 0, 6 * TOKENS)
    pieces = [(objs[0].tensor[:, :, 5:], slots[5:TOKENS])]
    pieces += [(objs[i].tensor, slots[i * TOKENS:(i + 1) * TOKENS]) for i in range(1, 5)]
    pieces.append((outsider, slots[5 * TOKENS:]))
    cache_list = [bits(torch.float32, (2, blocks, BLOCK_SIZE, HEADS, DIM), seed=20 + i) for i in range(LAYERS)]
    want = cache_list
    for chunk, s in pieces:
        want = scattered(chunk, want, s)
    plan = transfer.CopyPlan(pieces, threads=threads)
    assert [(r.first, r.count) for r in plan._runs] == [(1, 4)]
    assert plan._helpers() == [], "a run's op is torch's to split"
    parts, alone = plan._runs_of_wide
    assert len(parts) == 1 and parts[0][0].shape == (4, TOKENS) and alone == [0, 5]
    got = [c.clone() for c in cache_list]
    with CopyOps() as ops:
        plan.scatter(got)
    assert all(same(g, w) for g, w in zip(got, want))
    assert ops.count == 3 * LAYERS, "per layer: the run's one op and one for each piece alone"
    got = [c.clone() for c in cache_list]
    for layer in reversed(range(LAYERS)):
        plan.scatter_layer(layer, got[layer])
    assert all(same(g, w) for g, w in zip(got, want))


def test_a_run_of_one_window_groups_pieces_writes_only_their_layers() -> None:
    """Pieces holding layers 0 and 2 of the model (a window group's objects) in a run: layer 1's
    cache is left alone."""
    arena = Arena(8 * 4 * 2 * 2 * TOKENS * HEADS * DIM, 4 * 2 * 2 * TOKENS * HEADS * DIM)
    shape = (2, 2, TOKENS, HEADS, DIM)
    objs = [arena.allocate(shape, torch.float32) for _ in range(3)]
    for i, obj in enumerate(objs):
        obj.tensor.copy_(bits(torch.float32, shape, 40 + i))
    blocks = 3 * TOKENS // BLOCK_SIZE + 1
    slots = transfer.slot_mapping(list(range(blocks))[::-1], BLOCK_SIZE, 0, 3 * TOKENS)
    pieces = [(o.tensor, slots[i * TOKENS:(i + 1) * TOKENS]) for i, o in enumerate(objs)]
    cache_list = [bits(torch.float32, (2, blocks, BLOCK_SIZE, HEADS, DIM), seed=50 + i) for i in range(LAYERS)]
    plan = transfer.CopyPlan(pieces, layers=[(0, 2)] * 3)
    assert len(plan._runs) == 1
    got = [c.clone() for c in cache_list]
    plan.scatter(got)
    assert same(got[1], cache_list[1]), "layer 1 is no piece's"
    for model_layer, own in ((0, 0), (2, 1)):
        want = cache_list[model_layer]
        for obj, (_, s) in zip(objs, pieces):
            want = scattered(obj.tensor[own:own + 1], [want], s)[0]
        assert same(got[model_layer], want)
