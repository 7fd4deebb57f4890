"""Which devices kvlayer and the bundled engine run on, checked up front with a clear error."""

from __future__ import annotations

import torch


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` kvlayer and the engine can run on: the CPU, or a CUDA GPU
    this torch build and machine have. ValueError naming the device otherwise (torch itself
    would fail later with an AssertionError, or a RuntimeError about the string)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {str(device)!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.backends.cuda.is_built():
        raise ValueError(f"device {str(device)!r} is not available: this torch build has no CUDA")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} is not available: no CUDA GPU is visible")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} is not available: {torch.cuda.device_count()} CUDA GPU(s) visible")
    return dev
