"""Runs this folder's Triton kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before a module defining ``@triton.jit`` kernels is
imported (the decorator reads it), so it is set here, when pytest loads this conftest and
before it imports the test modules. The kernel tests are skipped where triton is missing.
The interpreter costs about 1 ms per program instance: tests keep grids to tens of programs.
"""

from __future__ import annotations

import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("triton") is None:
    collect_ignore = ["test_copy_kernels.py", "test_decode_attention.py"]
