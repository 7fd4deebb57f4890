"""Triton kernels of kvlayer's data path (docs/architecture.md section 6).

``copy_kernels`` holds the ``@triton.jit`` kernels, ``copy_ops`` their launch wrappers; both
import triton, so ``kvlayer.transfer`` imports them only when it runs a kernel. This package
itself imports nothing heavy: ``triton_available()`` asks whether triton is installed without
importing it.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None
