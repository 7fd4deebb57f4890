"""The Triton copy kernel on MLA-shaped caches (one plane, one head; ``LATENT_CACHE_LAYOUT``),
run by Triton's interpreter (conftest.py): exactly what the torch path copies."""

from __future__ import annotations

import torch

from kvlayer import transfer
from kvlayer.kernels import copy_ops
from tests.kvlayer.test_latent_layout import LATENT, LAYERS, MLA, latent_caches, rows

BLOCK = MLA.block_size


def test_the_triton_kernel_copies_latent_rows_as_the_torch_path_does() -> None:
    caches = [MLA.paged_view(c) for c in latent_caches(4)]
    slots = transfer.slot_mapping([5, 2, 9, 0], BLOCK, 3, 50)
    want = torch.empty((LAYERS, 1, len(slots), 1, LATENT))
    got = torch.full_like(want, float("nan"))
    transfer.gather(caches, slots, want, use_triton=False)
    copy_ops.gather(caches, slots, got)
    assert torch.equal(got, want) and torch.equal(want[:, 0, :, 0], rows(latent_caches(4), slots))
    back = [MLA.paged_view(c) for c in latent_caches(None)]
    copy_ops.scatter(want * 3, back, slots)
    torch_back = [MLA.paged_view(c) for c in latent_caches(None)]
    transfer.scatter(want * 3, torch_back, slots, use_triton=False)
    assert all(torch.equal(a, b) for a, b in zip(back, torch_back)) and back[2].abs().sum() > 0
