"""kvlayer: a pluggable, tiered KV cache layer for LLM inference.

``KVCacheEngine`` is the engine-agnostic API (lookup / store / retrieve over a paged KV
cache); ``KVLayerConfig`` its configuration; ``KVLayout`` describes a model's KV cache. The
bundled engine lives in ``kvlayer.engine`` and plugs kvlayer in through
``kvlayer.connectors``.

The three are imported on first use (PEP 562), so a command that needs no tensors (``kvlayer
admin``, ``kvlayer --help``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlayer.cache_engine import KVCacheEngine
    from kvlayer.config import ConfigError, KVLayerConfig
    from kvlayer.layout import KVLayout

__all__ = ["KVCacheEngine", "KVLayerConfig", "KVLayout", "ConfigError"]
__version__ = "0.1.0"

_HOMES = {"KVCacheEngine": "kvlayer.cache_engine", "KVLayerConfig": "kvlayer.config",
          "ConfigError": "kvlayer.config", "KVLayout": "kvlayer.layout"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'kvlayer' has no attribute {name!r}")
