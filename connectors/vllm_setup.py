"""What both sides of the vLLM connector derive from vLLM's configuration (docs/vllm.md).

``kvlayer_config`` reads kvlayer's own settings from ``kv_connector_extra_config`` (plus an
optional ``config_file`` there, and ``KVLAYER_*`` variables), validated as everywhere in kvlayer.
``cache_layout`` names how vLLM's attention backend lays out a layer's cache: FlashAttention's
``[2, blocks, block_size, heads, head_size]`` is kvlayer's own token layout; the CPU backend's
``[blocks, heads, block_size, 2 * head_size]`` packs each block its own way (keys transposed,
ISA-dependent), so kvlayer copies those blocks whole, as opaque bytes, under a namespace that
names the backend, its ISA and the block size. vLLM's MLA backends keep ``[blocks, block_size,
head_size]``: one latent vector per token (vLLM reports one KV head and the latent width as the
head size), kvlayer's ``LATENT_CACHE_LAYOUT``. Nothing here imports vLLM except where named.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvlayer.config import ConfigError, KVLayerConfig
from kvlayer.layout import BLOCKS, DEFAULT_CACHE_LAYOUT, LATENT_CACHE_LAYOUT, KVLayout
from kvlayer.model_files import model_fingerprint

CONFIG_FILE_KEY = "config_file"
"""The ``kv_connector_extra_config`` key naming a kvlayer YAML file; its other keys override it."""


def kvlayer_config(extra: Mapping[str, Any] | None) -> KVLayerConfig:
    """kvlayer's config from vLLM's ``kv_connector_extra_config``: defaults < ``config_file`` <
    the other keys < ``KVLAYER_*`` variables. ``ConfigError`` (one line, naming the key) for an
    unknown key or a bad value."""
    data = dict(extra or {})
    path = data.pop(CONFIG_FILE_KEY, None)
    base = KVLayerConfig.from_yaml(path).to_dict() if path else {}
    base.update(data)
    return KVLayerConfig.load(base)


def check_block_size(config: KVLayerConfig, block_size: int) -> None:
    """kvlayer's chunks must be whole vLLM blocks: ``ConfigError`` otherwise."""
    if config.chunk_size % block_size:
        raise ConfigError(f"chunk_size {config.chunk_size} must be a multiple of vLLM's block_size {block_size}")


def with_served_name(config: KVLayerConfig, vllm_config: Any) -> KVLayerConfig:
    """``config`` with vLLM's served model name (its first, if several) as ``served_model_name``,
    unless kvlayer's config sets one: the controller registers it, so lookups by it work."""
    served = getattr(vllm_config.model_config, "served_model_name", None)
    name = served[0] if isinstance(served, list | tuple) and served else served
    if config.served_model_name or not isinstance(name, str) or not name:
        return config
    return config.replace(served_model_name=name)


def model_identity(model: str, revision: str | None) -> tuple[str, str]:
    """``(model name, fingerprint)`` for the namespace: a local folder's weights fingerprint
    (``kvlayer.model_files``), else the hub id and revision."""
    folder = Path(model)
    if (folder / "config.json").is_file():
        return folder.resolve().name, model_fingerprint(folder)
    return model, f"hub:{model}@{revision or 'main'}"


def cache_layout(cache: torch.Tensor, num_kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype, num_layers: int, layer_windows: tuple[int | None, ...] = ()) -> KVLayout:
    """The ``KVLayout`` of vLLM layer caches shaped like ``cache``, with ``layer_windows``
    (``KVLayout.layer_windows``); ``ValueError`` naming the shape for a layout kvlayer does not know."""
    shape = tuple(cache.shape)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, num_kv_heads, head_size):
        return KVLayout(num_layers, num_kv_heads, head_size, dtype, block_size, DEFAULT_CACHE_LAYOUT, layer_windows)
    if len(shape) == 3 and shape[1:] == (block_size, head_size) and num_kv_heads == 1:
        return KVLayout(num_layers, 1, head_size, dtype, block_size, LATENT_CACHE_LAYOUT, layer_windows)
    if len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_size) and cache.device.type == "cpu":
        tag = f"vllm-cpu-{_cpu_isa(dtype, block_size, head_size)}-{platform.machine()}"
        return KVLayout(num_layers, num_kv_heads, head_size, dtype, block_size, BLOCKS + tag, layer_windows)
    raise ValueError(f"kvlayer does not know vLLM's KV cache layout {shape} on {cache.device} "
                     f"({num_kv_heads} kv heads, head size {head_size}, block size {block_size})")


def _cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention packs blocks for (it decides how a block's bytes are laid out)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:  # another vLLM version: never guess a packing shared with a known one
        return "unknown"
