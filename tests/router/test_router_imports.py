"""The router is a proxy that holds no KV: importing it loads neither torch nor the bundled engine."""

from __future__ import annotations

import subprocess
import sys


def test_the_router_imports_neither_torch_nor_the_engine():
    # A fresh interpreter: this test process has long since imported torch for other tests.
    code = ("import kvlayer.router.app, kvlayer.router.cli, sys;"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "('torch.', 'kvlayer.engine', 'kvlayer.cache_engine', 'kvlayer.connectors'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
