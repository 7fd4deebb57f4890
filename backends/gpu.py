"""The ``gpu`` tier: chunks in one arena on the engine's device (``ctx.device``).

Enabled when its ``capacity`` setting (``gpu_capacity``, ``backends/settings.py``) is > 0; the
hottest chunks, fastest to load into the paged cache. With ``ctx.device`` "cpu" (tests) the
same code runs on the host. All the logic lives in ``MemoryTier``.
"""

from __future__ import annotations

import torch

from kvlayer.backends.memory_tier import MemoryTier
from kvlayer.storage import BackendContext


class GpuBackend(MemoryTier):
    """Device-memory tier, rank 0, capacity its ``capacity`` setting (``gpu_capacity``)."""

    name = "gpu"
    rank = 0
    capacity_setting = "gpu_capacity"

    @classmethod
    def arena_device(cls, ctx: BackendContext) -> torch.device:
        return torch.device(ctx.device)
