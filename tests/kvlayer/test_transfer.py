"""Tests of kvlayer/transfer.py's torch path: gathers and scatters (one chunk, or several through a
``CopyPlan``) equal a token-by-token copy bit for bit, NaN payloads included, whether the rows
move as 16-byte elements or, where the layout does not allow that, as they are."""

from __future__ import annotations

import pytest
import torch

from kvlayer import transfer

LAYERS = 3
BLOCK_SIZE = 16
NUM_BLOCKS = 10
INTS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns as ``dtype``: NaNs with payloads, infinities and subnormals among them."""
    gen = torch.Generator().manual_seed(seed)
    ints = INTS[dtype]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=ints).view(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(INTS[a.dtype]), b.view(INTS[b.dtype]))


def caches(heads: int, dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    return [bits(dtype, (2, NUM_BLOCKS, BLOCK_SIZE, heads, dim), seed + i) for i in range(LAYERS)]


def slots_of(seed: int, start: int, end: int) -> torch.Tensor:
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    return transfer.slot_mapping(table, BLOCK_SIZE, start, end)


def scattered(chunk: torch.Tensor, cache_list: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """The reference: ``cache_list`` copied, then each token of ``chunk`` written to its slot one by one."""
    out = [c.clone() for c in cache_list]
    for layer, cache in enumerate(out):
        flat = cache.view(2, -1, *cache.shape[3:])
        for i, slot in enumerate(slots.tolist()):
            flat[:, slot] = chunk[layer, :, i]
    return out


def gathered(cache_list: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.stack([c.view(2, -1, *c.shape[3:])[:, s] for s in slots.tolist()], 1)
                        for c in cache_list])


# (heads, dim): rows of 1 KiB, 64 and 32 bytes move as 16-byte elements; rows of 12 bytes cannot
LAYOUTS = [(4, 64), (2, 16), (1, 8), (1, 3)]


@pytest.mark.parametrize("dtype", sorted(INTS, key=str), ids=str)
@pytest.mark.parametrize(("heads", "dim"), LAYOUTS)
def test_scatter_and_gather_equal_token_by_token_copies(dtype: torch.dtype, heads: int, dim: int) -> None:
    cache_list, slots = caches(heads, dim, dtype, seed=1), slots_of(2, 3, 45)
    chunk = bits(dtype, (LAYERS, 2, len(slots), heads, dim), seed=3)
    want = scattered(chunk, cache_list, slots)
    got = [c.clone() for c in cache_list]
    transfer.scatter(chunk, got, slots)
    assert all(same(g, w) for g, w in zip(got, want))
    one = cache_list[1].clone()
    transfer.scatter_layer(chunk[1], one, slots)
    assert same(one, want[1])
    out = torch.empty_like(chunk)
    transfer.gather(want, slots, out)
    assert same(out, gathered(want, slots))
    assert same(out, chunk)


def test_rows_move_as_16_byte_elements_only_where_the_layout_allows() -> None:
    cache = torch.zeros(2, 4, 16, 4, 64)
    flat = transfer._flat(cache)
    wide = transfer._wide(flat)
    assert wide is not None and wide.dtype == torch.complex128 and wide.shape == (2, 64, 64)
    assert wide.data_ptr() == cache.data_ptr(), "a view, not a copy"
    assert transfer._wide(torch.zeros(2, 8, 1, 3)) is None, "12-byte rows"
    assert transfer._wide(torch.zeros(2 * 8 * 4 * 4 + 1)[1:].view(2, 8, 4, 4)) is None, "4-byte aligned"
    assert transfer._wide(torch.zeros(2, 8, 16, 4).transpose(-1, -2)) is None, "rows not contiguous"
    assert transfer._wide(torch.zeros(2, 40, 4, 4)[:, 3:30]) is not None, "a token slice of a chunk"
    assert transfer._wide(torch.zeros(2, 8, 4, 4)[:, :, :, 1:]) is None, "gaps between a token's heads"


def test_a_single_scatter_moves_wide_rows_only_when_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its views cost more than they save below ``_WIDE_MIN_BYTES``; above, the result is the same."""
    calls = []
    real = transfer._wide
    monkeypatch.setattr(transfer, "_wide", lambda rows: calls.append(rows.shape) or real(rows))
    cache = bits(torch.float16, (2, 24, BLOCK_SIZE, 4, 64), seed=20)
    slots = transfer.slot_mapping(torch.randperm(24).tolist(), BLOCK_SIZE, 0, 256)
    for n in (16, 256):  # 2 x 16 x 512 bytes, then 2 x 256 x 512 bytes = _WIDE_MIN_BYTES
        calls.clear()
        chunk = bits(torch.float16, (LAYERS, 2, n, 4, 64), seed=n)
        want = scattered(chunk[1:2], [cache], slots[:n])[0]
        transfer.scatter_layer(chunk[1], cache, slots[:n])
        assert same(cache, want)
        assert len(calls) == (2 if n == 256 else 0), calls


def test_misaligned_and_strided_chunks_fall_back_and_stay_exact() -> None:
    cache_list, slots = caches(4, 4, torch.float32, seed=4), slots_of(5, 0, 20)
    n = LAYERS * 2 * 20 * 4 * 4
    misaligned = bits(torch.float32, (n + 1,), seed=6)[1:].view(LAYERS, 2, 20, 4, 4)
    transposed = bits(torch.float32, (LAYERS, 2, 20, 4, 4), seed=7).transpose(-1, -2)
    for chunk in (misaligned, transposed):
        want = scattered(chunk, cache_list, slots)
        got = [c.clone() for c in cache_list]
        transfer.scatter(chunk, got, slots)
        assert all(same(g, w) for g, w in zip(got, want))
        out = torch.empty_like(chunk)
        transfer.gather(want, slots, out)
        assert same(out, chunk)


@pytest.mark.parametrize(("heads", "dim", "threads"), [(4, 64, 1), (4, 64, 3), (1, 3, 2)])
def test_a_plan_moves_several_pieces_layer_by_layer(heads: int, dim: int, threads: int) -> None:
    """Whole chunks and token slices of chunks (a partial load), in one plan, each layer once;
    with ``threads`` > 1 the scatter shares the pieces with copy threads, to the same bytes."""
    cache_list = caches(heads, dim, torch.bfloat16, seed=8)
    slots = slots_of(9, 0, 100)
    chunks = [bits(torch.bfloat16, (LAYERS, 2, 32, heads, dim), seed=10 + i) for i in range(3)]
    pieces = [(chunks[0][:, :, 7:], slots[7:32]), (chunks[1], slots[32:64]), (chunks[2][:, :, :20], slots[64:84])]
    want = cache_list
    for chunk, s in pieces:
        want = scattered(chunk, want, s)
    got = [c.clone() for c in cache_list]
    plan = transfer.CopyPlan(pieces, threads=threads)
    assert len(plan._helpers()) == threads - 1
    for layer in reversed(range(LAYERS)):  # in any order, each once
        plan.scatter_layer(layer, got[layer])
    assert all(same(g, w) for g, w in zip(got, want))
    got = [c.clone() for c in cache_list]
    seen: list[int] = []
    plan.scatter(got, before=seen.append)  # the threads share the pieces; a plan may run again
    assert all(same(g, w) for g, w in zip(got, want))
    shared = threads if heads * dim * 2 % 16 == 0 else 1  # 6-byte rows are not 16-byte elements: one thread
    assert sorted(seen) == sorted(list(range(LAYERS)) * shared), "each thread announces each layer"
    outs = [torch.zeros(LAYERS, 2, 40, heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    back = transfer.CopyPlan([(outs[0][:, :, 5:30], slots[7:32]), (outs[1][:, :, :32], slots[32:64])])
    back.gather(want)
    assert same(outs[0][:, :, 5:30], chunks[0][:, :, 7:]) and same(outs[1][:, :, :32], chunks[1])
    assert not outs[0][:, :, :5].any() and not outs[0][:, :, 30:].any(), "only the pieces' tokens are written"
    transfer.CopyPlan([]).scatter(got)  # no pieces: nothing to do


def test_a_plan_leaves_big_pieces_to_torch_threads() -> None:
    """A piece whose layer is over ``_ONE_THREAD_BYTES`` is split by torch itself: no copy threads."""
    tokens = transfer._ONE_THREAD_BYTES // (2 * 4 * 64 * 4) + 16
    big = [(torch.zeros(1, 2, tokens, 4, 64), torch.arange(tokens)) for _ in range(2)]
    assert transfer.CopyPlan(big, threads=2)._helpers() == []
    small = [(torch.zeros(1, 2, 16, 4, 64), torch.arange(16)) for _ in range(2)]
    assert len(transfer.CopyPlan(small, threads=2)._helpers()) == 1
    assert transfer.CopyPlan(small[:1], threads=2)._helpers() == [], "one piece: nothing to share"


@pytest.mark.parametrize(("tokens", "threads", "element"), [(160, 2, torch.float64), (160, 1, torch.complex128),
                                                        (272, 2, torch.complex128), (96, 2, torch.complex128)])
def test_a_plan_moves_mid_sized_pieces_as_8_byte_elements_for_torch_threads(tokens: int, threads: int,
                                                                            element: torch.dtype) -> None:
    """A layer of 256-512 KiB (here 2 x ``tokens`` rows of 1 KiB) is one op torch keeps on one thread
    as 16-byte elements but splits as 8-byte ones: a plan allowed several threads moves it so,
    without copy threads, to the same bytes. A plan of one thread, or bigger or smaller pieces,
    keeps 16-byte elements."""
    blocks = 2 * tokens // BLOCK_SIZE + 4
    cache_list = [bits(torch.float32, (2, blocks, BLOCK_SIZE, 4, 64), seed=3 + i) for i in range(LAYERS)]
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(5)).tolist()
    slots = transfer.slot_mapping(table, BLOCK_SIZE, 0, 2 * tokens)
    chunks = [bits(torch.float32, (LAYERS, 2, tokens, 4, 64), seed=20 + i) for i in range(2)]
    pieces = [(chunks[0], slots[:tokens]), (chunks[1], slots[tokens:])]
    want = cache_list
    for chunk, s in pieces:
        want = scattered(chunk, want, s)
    plan = transfer.CopyPlan(pieces, threads=threads)
    assert plan._elements == [element, element]
    if element is torch.float64:
        assert plan._helpers() == [], "torch's own threads split each piece"
    got = [c.clone() for c in cache_list]
    plan.scatter(got)
    assert all(same(g, w) for g, w in zip(got, want))


def test_opaque_blocks_move_whole_through_their_paged_view() -> None:
    """A ``blocks:`` layout (vLLM's CPU cache ``[blocks, heads, block_size, 2 * dim]``, packed its
    own way): a plan moves whole blocks, byte for byte, to and from the block ids given."""
    from kvlayer.layout import KVLayout

    heads, dim = 2, 8
    layout = KVLayout(LAYERS, heads, dim, torch.float32, BLOCK_SIZE, "blocks:test")
    assert layout.copy_unit == BLOCK_SIZE
    engine = [bits(torch.float32, (NUM_BLOCKS, heads, BLOCK_SIZE, 2 * dim), seed=30 + i) for i in range(LAYERS)]
    views = [layout.paged_view(c) for c in engine]
    assert views[0].shape == (1, NUM_BLOCKS, 1, 1, heads * BLOCK_SIZE * 2 * dim)
    assert views[0].data_ptr() == engine[0].data_ptr(), "a view, not a copy"
    chunk = bits(torch.float32, layout.chunk_shape(3 * BLOCK_SIZE), seed=32)
    rows = layout.chunk_view(chunk)
    ids = torch.tensor([7, 2, 4])
    transfer.CopyPlan([(rows[:, :, :1], ids[:1]), (rows[:, :, 1:], ids[1:])], threads=2).scatter(views)
    for layer, cache in enumerate(engine):
        for i, block in enumerate(ids.tolist()):
            assert same(cache[block].flatten(), rows[layer, 0, i, 0]), "block i of the chunk is engine block ids[i]"
    out = torch.empty_like(chunk)
    transfer.CopyPlan([(layout.chunk_view(out), ids)]).gather(views)
    assert same(out, chunk)
    for wrong in (torch.zeros(3, heads, BLOCK_SIZE, dim), engine[0].half(), engine[0].transpose(0, 1)):
        with pytest.raises(ValueError, match="does not fit|contiguous"):
            layout.paged_view(wrong)
    with pytest.raises(ValueError, match="unknown cache layout"):
        KVLayout(LAYERS, heads, dim, torch.float32, BLOCK_SIZE, "blocks:")
