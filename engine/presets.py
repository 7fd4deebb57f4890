"""Random-weight model folders in Hugging Face format, for tests, demos and benchmarks.

``init_model("tiny", folder, seed=0)`` writes ``config.json`` (loadable by transformers'
Llama/Mistral/Qwen2 classes), ``model.safetensors`` (or shards plus an index) and a byte-level
``tokenizer.json``. The same preset, seed and options always give byte-identical files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvlayer.engine.loader import INDEX_FILE, checkpoint_shapes
from kvlayer.engine.model_config import ModelConfig, RopeScaling, parse_model_config
from kvlayer.engine.tokenizer import BOS_TOKEN, EOS_TOKEN, byte_tokenizer


@dataclass(frozen=True, slots=True)
class Preset:
    """The shape of a random model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 16, 128, 512, 4096),
    "small": Preset(256, 4, 8, 4, 32, 512, 1024, 8192),
    # ~125M parameters; float32 KV is 12 layers * 2 * 4 heads * 64 * 4 B = 24 KiB per token
    "bench": Preset(768, 12, 12, 4, 64, 2048, 32000, 32768),
}

@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """Which layers of a preset model slide, as ``init_model`` writes it into ``config.json``.

    ``sliding_window`` is the window (None: full attention everywhere). Qwen2 only:
    ``max_window_layers`` layers from the first on stay full (transformers' rule when
    ``layer_types`` is absent), or ``layer_types`` names each layer's kind
    ("full_attention" / "sliding_attention") for a hybrid model.
    """

    sliding_window: int | None = None
    max_window_layers: int = 0
    layer_types: tuple[str, ...] | None = None

    @property
    def per_layer(self) -> bool:
        return self.max_window_layers != 0 or self.layer_types is not None


def _llama_fields(attention: AttentionLayout) -> dict[str, Any]:
    if attention.sliding_window is not None or attention.per_layer:
        raise ValueError("sliding_window and layer_types are not supported by architecture 'llama'")
    return {"attention_bias": False, "mlp_bias": False}


def _mistral_fields(attention: AttentionLayout) -> dict[str, Any]:
    if attention.per_layer:  # transformers' Mistral slides every layer, whatever layer_types says
        raise ValueError("max_window_layers and layer_types are not supported by architecture 'mistral'")
    return {"sliding_window": attention.sliding_window}


def _qwen2_fields(attention: AttentionLayout) -> dict[str, Any]:
    window = attention.sliding_window
    fields = {"use_sliding_window": window is not None, "sliding_window": window,
              "max_window_layers": attention.max_window_layers}
    if attention.layer_types is not None:
        fields["layer_types"] = list(attention.layer_types)
    return fields


@dataclass(frozen=True, slots=True)
class _Family:
    """How ``init_model`` writes one architecture's config: its class name and its own fields."""

    class_name: str
    fields: Callable[[AttentionLayout], dict[str, Any]]  # raises ValueError for options it cannot write


_FAMILIES: dict[str, _Family] = {
    "llama": _Family("LlamaForCausalLM", _llama_fields),
    "mistral": _Family("MistralForCausalLM", _mistral_fields),
    "qwen2": _Family("Qwen2ForCausalLM", _qwen2_fields),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BOS_ID, _EOS_ID = 256, 257


def init_model(
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    architecture: str = "llama",
    shard_size: int | None = None,
    *,
    rope_scaling: RopeScaling | None = None,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
    layer_types: Sequence[str] | None = None,
) -> Path:
    """Write a random model folder at ``out`` (created; must not hold files yet) and return it.

    ``architecture`` is "llama", "mistral" or "qwen2" (q/k/v biases). ``shard_size`` (bytes)
    splits the weights into shards of at most that size (one tensor may exceed it) with a
    ``model.safetensors.index.json``. ``tie_word_embeddings`` overrides the preset's choice;
    ``sliding_window`` is written for Mistral and Qwen2 (which then sets ``use_sliding_window``);
    for Qwen2, ``max_window_layers`` or ``layer_types`` choose which layers slide (see
    ``AttentionLayout``). Raises ValueError for an unknown preset, architecture or dtype or an
    option the architecture does not have, FileExistsError for a non-empty ``out``.
    """
    raw = preset_config(
        preset,
        architecture,
        dtype,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        sliding_window=sliding_window,
        max_window_layers=max_window_layers,
        layer_types=layer_types,
    )
    folder = Path(out)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"model folder {str(folder)!r} is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    config = parse_model_config(raw, default_name=folder.name)
    tensors = random_weights(config, seed, _DTYPES[dtype])
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _save_weights(tensors, folder, shard_size)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return folder


def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor of ``config``'s checkpoint, in ``dtype``.

    The embedding is normal(0, 0.02) and every other matrix normal(0, 1/sqrt(fan_in)), so each
    layer moves the residual stream much more than the embedding does and attention scores are
    of order one: greedy decoding then yields varied tokens, with tied embeddings too (where a
    residual dominated by the embedding would make every token predict itself). Biases are
    normal(0, 0.1) and norm weights 1 + normal(0, 0.1).
    """
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            tensor = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            tensor = 0.02 * noise
        else:
            tensor = noise / shape[1] ** 0.5
        weights[name] = tensor.to(dtype).contiguous()
    return weights


def preset_config(
    preset: str,
    architecture: str = "llama",
    dtype: str = "float32",
    *,
    rope_scaling: RopeScaling | None = None,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
    layer_types: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` dict ``init_model`` writes for these options (see there); ValueError
    names an unknown preset, architecture or dtype, or an option the architecture lacks."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    if architecture not in _FAMILIES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(_FAMILIES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(_DTYPES)}")
    family = _FAMILIES[architecture]
    attention = AttentionLayout(sliding_window, max_window_layers, None if layer_types is None else tuple(layer_types))
    fields = family.fields(attention)
    spec = PRESETS[preset]
    tied = spec.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
    return {
        "architectures": [family.class_name],
        "model_type": architecture,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling.to_hf() if rope_scaling is not None else None,
        "tie_word_embeddings": tied,
        "bos_token_id": _BOS_ID,
        "eos_token_id": _EOS_ID,
        "torch_dtype": dtype,
        "use_cache": True,
        **fields,
    }


def _save_weights(tensors: dict[str, torch.Tensor], folder: Path, shard_size: int | None) -> None:
    """One ``model.safetensors``, or shards of at most ``shard_size`` bytes plus an index."""
    if shard_size is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > shard_size:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
