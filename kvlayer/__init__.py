"""kvlayer: a pluggable, tiered KV cache layer for LLM inference.

``KVCacheEngine`` is the engine-agnostic API (lookup / store / retrieve over a paged KV
cache); ``KVLayerConfig`` its configuration; ``KVLayout`` describes a model's KV cache. The
bundled engine lives in ``kvlayer.engine`` and plugs kvlayer in through
``kvlayer.connectors``.
"""

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.config import ConfigError, KVLayerConfig
from kvlayer.layout import KVLayout

__all__ = ["KVCacheEngine", "KVLayerConfig", "KVLayout", "ConfigError"]
__version__ = "0.1.0"
