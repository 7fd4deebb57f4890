"""The ``cpu`` tier: chunks in one pinned host arena (plain memory where CUDA is absent).

Enabled when ``config.cpu_capacity > 0``; the staging tier for everything below it. All the
logic lives in ``MemoryTier``.
"""

from __future__ import annotations

import torch

from kvlayer.backends.memory_tier import MemoryTier
from kvlayer.storage import BackendContext


class CpuBackend(MemoryTier):
    """Host-memory tier, rank 10, capacity ``config.cpu_capacity``."""

    name = "cpu"
    rank = 10
    capacity_setting = "cpu_capacity"
    pin_host = True

    @classmethod
    def arena_device(cls, ctx: BackendContext) -> torch.device:
        return torch.device("cpu")
