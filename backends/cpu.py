"""The ``cpu`` tier: chunks in one pinned host arena (plain memory where CUDA is absent).

Enabled when its ``capacity`` setting (``cpu_capacity``, ``backends/settings.py``) is > 0; the
staging tier for everything below it. All the logic lives in ``MemoryTier``.
"""

from __future__ import annotations

import torch

from kvlayer.backends.memory_tier import MemoryTier
from kvlayer.storage import BackendContext


class CpuBackend(MemoryTier):
    """Host-memory tier, rank 10, capacity its ``capacity`` setting (``cpu_capacity``)."""

    name = "cpu"
    rank = 10
    capacity_setting = "cpu_capacity"
    pin_host = True

    @classmethod
    def arena_device(cls, ctx: BackendContext) -> torch.device:
        return torch.device("cpu")
