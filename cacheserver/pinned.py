"""The mapped arena registered with CUDA as pinned host memory, when the engine's KV is on CUDA.

``cudaHostRegister`` (through ``torch.cuda.cudart()``, flag ``cudaHostRegisterPortable``: pinned
for every CUDA context of the process) page-locks the mapping in place, so the copies between
the engine's paged KV on the GPU and the arena are DMA transfers that run asynchronously on the
current stream (``kvlayer.transfer``'s ``copy_(non_blocking=True)``, completed by
``wait_for_copies`` before a chunk's object is released), instead of staged pageable copies.

Thin on purpose: ``register`` answers False, doing nothing, off CUDA (it never initialises CUDA
for a CPU engine, and nothing CUDA-only is imported at import time); a refusal (too little
lockable memory, a driver without the support) is one warning and False, and the copies stay
pageable: slower, as exact. ``unregister`` waits for the device's queued work first, so no copy
still reads or writes the range when it stops being pinned.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PORTABLE = 1
"""``cudaHostRegisterPortable``."""


def wanted(device: torch.device) -> bool:
    """Whether an engine on ``device`` would pin the arena: a CUDA device, and CUDA available."""
    return device.type == "cuda" and torch.cuda.is_available()


def register(address: int, size: int, device: torch.device) -> bool:
    """Page-lock ``[address, address + size)`` (a mapping owned by the caller, which must call
    ``unregister(address, device)`` before unmapping it) for the CUDA ``device``; False, doing
    nothing, unless ``wanted(device)``, and False with one warning when CUDA refuses."""
    if not wanted(device) or size <= 0:
        return False
    try:
        with torch.cuda.device(device):
            code = int(torch.cuda.cudart().cudaHostRegister(address, size, PORTABLE))
    except (RuntimeError, AssertionError, AttributeError) as e:  # no cudart binding, a broken context
        code, why = -1, repr(e)
    else:
        why = f"CUDA error {code}"
    if code != 0:
        log.warning("kvlayer cache tier: the shared arena (%d MiB) could not be registered as pinned memory (%s); "
                    "its copies stay pageable", size >> 20, why)
        return False
    return True


def unregister(address: int, device: torch.device) -> None:
    """Undo ``register(address, ...)`` once ``device``'s queued copies are done; a failure is logged."""
    try:
        torch.cuda.synchronize(device)
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
    except (RuntimeError, AssertionError, AttributeError) as e:
        log.warning("kvlayer cache tier: unregistering the shared arena failed: %r", e)
        return
    if code != 0:
        log.warning("kvlayer cache tier: unregistering the shared arena failed (CUDA error %d)", code)
