"""A CPU gather shared among threads (``CopyPlan.gather`` with ``threads``, ``SaveJob.gather_all``,
``KVCacheEngine.store``) gives the same bytes as one thread, and the per-layer path beside
compute (``CopyPlan.gather_layer``, ``SaveJob.layer``) never leaves the caller's thread.
Run: ``.venv/bin/python -m pytest tests/kvlayer/test_gather_threads.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from kvlayer import KVCacheEngine, KVLayout, transfer
from kvlayer.backends.cpu import CpuBackend
from tests.kvlayer.test_transfer import BLOCK_SIZE, LAYERS, NUM_BLOCKS, bits, caches, gathered, same, slots_of


def pieces_of(dtype: torch.dtype, heads: int, dim: int,
              slots: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Five NaN-filled chunks and a piece of each over ``slots`` (tokens 3.. of the chunk: token
    slices of different sizes)."""
    bounds = [(0, 16), (16, 48), (48, 57), (57, 89), (89, 120)]
    chunks = [torch.full((LAYERS, 2, 40, heads, dim), float("nan"), dtype=dtype) for _ in bounds]
    return chunks, [(c[:, :, 3 : 3 + hi - lo], slots[lo:hi]) for c, (lo, hi) in zip(chunks, bounds)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("threads", [2, 3])
def test_a_threaded_gather_equals_one_thread_bit_for_bit(dtype: torch.dtype, threads: int) -> None:
    cache_list = caches(4, 16, dtype, seed=40)  # random bit patterns: NaN payloads, subnormals
    slots = slots_of(41, 0, 120)  # a random block table
    (ones, one), (manys, many) = pieces_of(dtype, 4, 16, slots), pieces_of(dtype, 4, 16, slots)
    transfer.CopyPlan(one, threads=1).gather(cache_list)
    plan = transfer.CopyPlan(many, threads=threads)
    assert len(plan._gather_helpers(cache_list)) == threads - 1, "the pieces are shared"
    plan.gather(cache_list)
    untouched = torch.full((LAYERS, 2, 3, 4, 16), float("nan"), dtype=dtype)
    for a, b, (_, s) in zip(ones, manys, many):
        assert same(a, b)
        assert same(b[:, :, 3 : 3 + len(s)], gathered(cache_list, s)), "each token from its slot, every layer"
        assert same(b[:, :, :3], untouched) and same(b[:, :, 3 + len(s) : 6 + len(s)], untouched[:, :, :3]), \
            "nothing outside the piece"


def test_a_threaded_gather_leaves_other_window_groups_alone() -> None:
    """Pieces holding some layers only (``layers``): each thread fills just those."""
    cache_list = caches(2, 8, torch.float32, seed=42)
    slots = slots_of(43, 0, 64)
    chunks = [torch.zeros(1 if i % 2 else LAYERS, 2, 16, 2, 8) for i in range(4)]
    ids = [(1,) if i % 2 else () for i in range(4)]
    plan = transfer.CopyPlan([(c, slots[16 * i : 16 * i + 16]) for i, c in enumerate(chunks)], threads=2, layers=ids)
    plan.gather(cache_list)
    for i, c in enumerate(chunks):
        want = gathered(cache_list, slots[16 * i : 16 * i + 16])
        assert same(c, want[1:2] if i % 2 else want)


def test_a_gather_keeps_to_one_thread_unless_it_may_share() -> None:
    cache_list = caches(2, 8, torch.float32, seed=44)
    slots = slots_of(45, 0, 32)
    two = [(torch.zeros(LAYERS, 2, 16, 2, 8), slots[:16]), (torch.zeros(LAYERS, 2, 16, 2, 8), slots[16:])]
    assert transfer.CopyPlan(two)._gather_helpers(cache_list) == [], "threads=1 by default"
    assert transfer.CopyPlan(two[:1], threads=2)._gather_helpers(cache_list) == [], "one piece: nothing to share"
    assert transfer.CopyPlan(two, threads=2, use_triton=True)._gather_helpers(cache_list) == [], "Triton: one launch"


def test_the_per_layer_gather_stays_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gather_layer`` runs beside the forward pass: it never hands work to the copy threads."""
    def no_threads(n: int) -> list[object]:
        raise AssertionError("a per-layer gather used copy threads")

    monkeypatch.setattr(transfer, "_copy_threads", no_threads)
    cache_list = caches(2, 8, torch.float16, seed=46)
    slots = slots_of(47, 0, 48)
    pieces = [(torch.zeros(LAYERS, 2, 16, 2, 8, dtype=torch.float16), slots[16 * i : 16 * i + 16]) for i in range(3)]
    plan = transfer.CopyPlan(pieces, threads=2)
    for layer in reversed(range(LAYERS)):
        plan.gather_layer(layer, cache_list[layer])
    for chunk, s in pieces:
        assert same(chunk, gathered(cache_list, s))


def test_store_gathers_on_the_copy_threads_to_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVCacheEngine.store`` (nothing computes beside it) shares its chunks with the copy
    threads; the chunks the CPU tier then holds are the cache's KV at the slots, bit for bit."""
    layout = KVLayout(LAYERS, 2, 8, torch.bfloat16, BLOCK_SIZE)
    names: set[str] = set()
    real = transfer.CopyPlan._gather_share

    def spy(self: transfer.CopyPlan, *args: object) -> None:
        names.add(threading.current_thread().name)
        real(self, *args)

    monkeypatch.setattr(transfer.CopyPlan, "_gather_share", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cache_list = [bits(torch.bfloat16, (2, NUM_BLOCKS, BLOCK_SIZE, 2, 8), seed=50 + i) for i in range(LAYERS)]
    slots = slots_of(51, 0, 128)
    tokens = list(range(300, 428))
    with KVCacheEngine({"chunk_size": 32, "cpu_capacity": "1MiB"}, layout, model_name="m") as eng:
        assert eng.store(tokens, cache_list, slots) == 4
        assert any(n.startswith("kvlayer-copy-") for n in names) and threading.current_thread().name in names
        cpu = next(b for b in eng.backends if isinstance(b, CpuBackend))
        for key in eng.keys(tokens):
            [obj] = eng.loop.run(cpu.get_many([key]))
            assert obj is not None
            try:
                assert same(layout.chunk_view(obj.tensor), gathered(cache_list, slots[key.start : key.end]))
            finally:
                obj.release()
