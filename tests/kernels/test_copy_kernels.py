"""Tests of kvlayer/kernels/copy_ops.py and transfer.py's dispatch: Triton gather/scatter (run by
Triton's interpreter, see conftest.py), alone or through a ``CopyPlan``, equal the torch functions exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvlayer import transfer
from kvlayer.kernels import copy_ops

BLOCK_SIZE = 16
NUM_BLOCKS = 12
LAYERS = 3
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS_DIMS = [(2, 16), (1, 64), (4, 128)]


def _caches(heads: int, dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, heads, dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]


def _table_slots(seed: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions [start, end) of a sequence whose blocks are a random permutation."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    return transfer.slot_mapping(table, BLOCK_SIZE, start, end)


# partial first and last blocks; then reads in any order with repeats (gather only)
READS = {
    "table": lambda: _table_slots(1, 5, 50),
    "repeated": lambda: torch.cat([_table_slots(2, 0, 20), _table_slots(2, 3, 13).flip(0)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "dim"), HEADS_DIMS)
@pytest.mark.parametrize("reads", sorted(READS))
def test_gather_equals_torch(dtype: torch.dtype, heads: int, dim: int, reads: str) -> None:
    caches, slots = _caches(heads, dim, dtype, seed=heads * dim), READS[reads]()
    want = torch.empty((LAYERS, 2, len(slots), heads, dim), dtype=dtype)
    got = torch.full_like(want, float("nan"))
    transfer.gather(caches, slots, want, use_triton=False)
    copy_ops.gather(caches, slots, got)
    assert torch.equal(got, want)
    one = torch.full_like(want[1], float("nan"))
    copy_ops.gather_layer(caches[1], slots, one)
    assert torch.equal(one, want[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "dim"), HEADS_DIMS)
def test_scatter_equals_torch(dtype: torch.dtype, heads: int, dim: int) -> None:
    slots = _table_slots(3, 7, 41)
    chunk = torch.randn((LAYERS, 2, len(slots), heads, dim)).to(dtype)
    want, got = _caches(heads, dim, dtype, seed=0), _caches(heads, dim, dtype, seed=0)
    transfer.scatter(chunk, want, slots, use_triton=False)
    copy_ops.scatter(chunk, got, slots)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    one = want[0].clone()
    copy_ops.scatter_layer(chunk[0] * 2, one, slots)
    transfer.scatter_layer(chunk[0] * 2, want[0], slots, use_triton=False)
    assert torch.equal(one, want[0])


def test_transfer_dispatch_with_strided_chunks() -> None:
    """A chunk slice (kvlayer's partial loads) is addressed in place; a chunk whose token rows are
    not contiguous goes through a staging buffer; both equal torch."""
    caches, slots = _caches(2, 16, torch.bfloat16, seed=4), _table_slots(4, 0, 30)
    full = torch.randn((LAYERS, 2, 40, 2, 16)).to(torch.bfloat16)
    want, got = _caches(2, 16, torch.bfloat16, seed=5), _caches(2, 16, torch.bfloat16, seed=5)
    transfer.scatter(full[:, :, 10:], want, slots, use_triton=False)
    transfer.scatter(full[:, :, 10:], got, slots, use_triton=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    transposed = torch.empty((LAYERS, 2, 30, 16, 2), dtype=torch.bfloat16).transpose(-1, -2)
    assert not copy_ops.rows_contiguous(transposed)
    reference = torch.empty((LAYERS, 2, 30, 2, 16), dtype=torch.bfloat16)
    transfer.gather(caches, slots, transposed, use_triton=True)
    transfer.gather(caches, slots, reference, use_triton=False)
    assert torch.equal(transposed, reference)
    layer = torch.empty((2, 30, 16, 2), dtype=torch.bfloat16).transpose(-1, -2)
    transfer.gather_layer(caches[2], slots, layer, use_triton=True)
    assert torch.equal(layer, reference[2])
    transfer.scatter_layer(reference[2] + 1, got[1], slots, use_triton=True)
    transfer.scatter_layer(reference[2] + 1, want[1], slots, use_triton=False)
    assert torch.equal(got[1], want[1])


def test_a_copy_plan_runs_the_kernels_for_each_piece() -> None:
    """A plan's pieces (a whole chunk and a token slice of one) through Triton equal the torch path,
    layer by layer and all layers at once."""
    slots = _table_slots(8, 0, 40)
    chunks = [torch.randn((LAYERS, 2, 24, 2, 16)).to(torch.float16) for _ in range(2)]
    pieces = [(chunks[0][:, :, 4:], slots[:20]), (chunks[1][:, :, :20], slots[20:])]
    want, got = _caches(2, 16, torch.float16, seed=8), _caches(2, 16, torch.float16, seed=8)
    transfer.CopyPlan(pieces, use_triton=False).scatter(want)
    plan = transfer.CopyPlan(pieces, use_triton=True)
    plan.scatter_layer(1, got[1])
    assert torch.equal(got[1], want[1])
    plan.scatter(got)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    outs = [torch.zeros((LAYERS, 2, 24, 2, 16), dtype=torch.float16) for _ in range(2)]
    back = transfer.CopyPlan([(outs[0][:, :, 4:], slots[:20]), (outs[1][:, :, :20], slots[20:])], use_triton=True)
    back.gather(want)
    assert torch.equal(outs[0][:, :, 4:], chunks[0][:, :, 4:]) and torch.equal(outs[1][:, :, :20], chunks[1][:, :, :20])
    back.gather_layer(2, got[0])
    assert torch.equal(outs[0][2, :, 4:], chunks[0][0, :, 4:])


def test_tiles_stay_powers_of_two_near_the_budget() -> None:
    assert copy_ops.tiles(2 * 16, 45) == (64, 32)
    assert copy_ops.tiles(8 * 128, 300) == (4, 1024)
    assert copy_ops.tiles(32 * 128, 300) == (4, 1024)  # a row wider than a tile is walked in steps
    assert copy_ops.tiles(80, 1) == (1, 128)


def test_bad_arguments_are_refused() -> None:
    caches, slots = _caches(2, 16, torch.float32, seed=6), _table_slots(6, 0, 8)
    out = torch.empty((LAYERS, 2, 8, 2, 16), dtype=torch.float16)
    with pytest.raises(ValueError, match="chunk is"):
        copy_ops.gather(caches, slots, out)
    with pytest.raises(ValueError, match="slots must be"):
        copy_ops.gather(caches, slots.float(), out.float())
    with pytest.raises(ValueError, match="does not match"):
        copy_ops.gather(caches[:2], slots, out.float())
    with pytest.raises(ValueError, match="one shape"):
        copy_ops.scatter(out.float(), [caches[0], caches[1][:, :6], caches[2]], slots)


def test_cpu_tensors_never_launch_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Triton copy ran for CPU tensors")

    for name in ("gather", "scatter", "gather_layer", "scatter_layer"):
        monkeypatch.setattr(copy_ops, name, refuse)
    caches, slots = _caches(2, 16, torch.float32, seed=7), _table_slots(7, 0, 20)
    chunk = torch.empty((LAYERS, 2, 20, 2, 16))
    transfer.gather(caches, slots, chunk)
    transfer.scatter(chunk, caches, slots)
    transfer.gather_layer(caches[0], slots, chunk[0])
    transfer.scatter_layer(chunk[0], caches[0], slots)


CPU_ONLY = """
import sys, torch
from kvlayer import transfer
from kvlayer.engine.attention import paged_attention
from kvlayer.engine.attention_metadata import AttentionMetadata
caches = [torch.randn(2, 4, 16, 2, 16) for _ in range(2)]
slots = transfer.slot_mapping([3, 1], 16, 0, 20)
chunk = torch.empty(2, 2, 20, 2, 16)
transfer.gather(caches, slots, chunk)
transfer.scatter(chunk, caches, slots)
transfer.gather_layer(caches[0], slots, chunk[0])
transfer.scatter_layer(chunk[0], caches[0], slots)
meta = AttentionMetadata(torch.zeros(2, dtype=torch.long), 2, torch.tensor([[3, 1], [2, 0]]),
                         torch.tensor([20, 5]), (), 16)
q = torch.randn(2, 4, 16)
paged_attention(q, q, q, caches[1], meta, 0.25)
print("triton" in sys.modules)
"""


def test_cpu_path_does_not_even_import_triton() -> None:
    """Without the interpreter, a launch would fail ("0 active drivers"): the CPU path must not try."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CPU_ONLY], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
