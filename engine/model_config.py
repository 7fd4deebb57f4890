"""A Llama-family model's configuration, parsed and validated from its Hugging Face ``config.json``.

``load_model_config(folder)`` reads ``folder/config.json`` and returns a frozen ``ModelConfig``
for the architectures the bundled engine runs: Llama, Mistral and Qwen2 (with default or
llama3-scaled RoPE). Anything it cannot run exactly is a ``ModelConfigError`` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RopeType = Literal["default", "llama3"]


class ModelConfigError(ValueError):
    """A model folder or ``config.json`` the engine cannot run; the message names the field."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. ``llama3`` (Llama 3.1) divides low frequencies by ``factor`` and
    blends the band between ``original_max_position_embeddings / low_freq_factor`` and
    ``/ high_freq_factor`` wavelengths; ``default`` leaves frequencies as they are.
    """

    rope_type: RopeType = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ModelConfigError(f"rope_scaling.rope_type {self.rope_type!r} is unsupported")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ModelConfigError(f"rope_scaling.{name} must be a positive number, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ModelConfigError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        _check_positive_int(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict of a Hugging Face ``config.json``."""
        return {
            "rope_type": self.rope_type,
            "factor": float(self.factor),
            "low_freq_factor": float(self.low_freq_factor),
            "high_freq_factor": float(self.high_freq_factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs to build, load and run a decoder-only Llama-family model.

    ``qkv_bias``/``o_bias``: whether the q/k/v and o projections carry biases (Qwen2: q/k/v
    only; Llama with ``attention_bias``: all four). ``layer_windows[i]`` is layer ``i``'s
    sliding window, None for full attention: a query at position ``p`` attends to keys at
    positions ``j`` with ``p - window < j <= p`` (transformers' ``sliding_window_overlay``).
    ``rope_scaling`` None means plain RoPE.
    """

    architecture: Literal["llama", "mistral", "qwen2"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    layer_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    model_name: str

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_key_value_heads ({self.num_kv_heads}) must divide "
                f"num_attention_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ModelConfigError(f"{name} must be a positive number, got {value!r}")
        if len(self.layer_windows) != self.num_layers:
            raise ModelConfigError(
                f"{len(self.layer_windows)} layer windows for num_hidden_layers {self.num_layers}"
            )
        for window in self.layer_windows:
            if window is not None:
                _check_positive_int("sliding_window", window)
        if self.bos_token_id is not None:
            _check_token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        for token in self.eos_token_ids:
            _check_token_id("eos_token_id", token, self.vocab_size)

    @property
    def max_model_len(self) -> int:
        """The longest sequence the engine runs: the RoPE tables cover this many positions."""
        return self.max_position_embeddings

    @property
    def sliding_window(self) -> int | None:
        """The largest window of the model's sliding-window layers; None when no layer slides."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def attention_reach(self) -> int | None:
        """How far back the model ever attends: the largest window when every layer slides (keys
        this many positions behind the next query are never read again), else None."""
        return None if None in self.layer_windows else self.sliding_window


@dataclass(frozen=True, slots=True)
class _Family:
    """How one architecture's config.json spells the options that differ between families."""

    qkv_bias: Callable[[Mapping[str, Any]], bool]
    o_bias: Callable[[Mapping[str, Any]], bool]
    layer_windows: Callable[[Mapping[str, Any], int], tuple[Any, ...]]  # (raw, num_layers) -> windows


def _attention_bias(raw: Mapping[str, Any]) -> bool:
    return _typed(raw, "attention_bias", bool, False)


_DEFAULT_WINDOW = 4096
"""transformers' ``MistralConfig``/``Qwen2Config`` default when ``sliding_window`` is absent
(an explicit null means no window)."""


def _mistral_windows(raw: Mapping[str, Any], num_layers: int) -> tuple[Any, ...]:
    # transformers' Mistral gives every layer the window and ignores layer_types (with a warning)
    return (raw.get("sliding_window", _DEFAULT_WINDOW),) * num_layers


def _qwen2_windows(raw: Mapping[str, Any], num_layers: int) -> tuple[Any, ...]:
    """transformers' ``Qwen2Config``: the window only with ``use_sliding_window``; ``layer_types``
    when given, else layers from ``max_window_layers`` (default 28) on slide."""
    use = _typed(raw, "use_sliding_window", bool, False)
    window = raw.get("sliding_window", _DEFAULT_WINDOW) if use else None
    types = raw.get("layer_types")
    if types is None:
        first = _typed(raw, "max_window_layers", int, 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelConfigError(f"layer_types must be a list of num_hidden_layers ({num_layers}) names, got {types!r}")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ModelConfigError(f"layer_types {sorted(map(str, unknown))} are unsupported; "
                               f"supported: full_attention, sliding_attention")
    if window is None and "sliding_attention" in types:
        raise ModelConfigError("layer_types has sliding_attention layers but no sliding_window "
                               "(use_sliding_window is false or sliding_window is null)")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


_FAMILIES: dict[str, _Family] = {
    # transformers' Llama has no sliding window and ignores layer_types
    "llama": _Family(_attention_bias, _attention_bias, lambda raw, num_layers: (None,) * num_layers),
    "mistral": _Family(lambda raw: False, lambda raw: False, _mistral_windows),
    "qwen2": _Family(lambda raw: True, lambda raw: False, _qwen2_windows),
}
_ARCHITECTURE_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse ``path/config.json``; ``ModelConfigError`` names what is missing, unsupported or bad."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelConfigError(f"model folder {str(folder)!r} does not exist or is not a directory")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelConfigError(f"config.json is missing from model folder {str(folder)!r}")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelConfigError(f"config.json in {str(folder)!r} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"config.json in {str(folder)!r} must hold a JSON object")
    return parse_model_config(raw, default_name=folder.resolve().name)


def parse_model_config(raw: Mapping[str, Any], default_name: str = "model") -> ModelConfig:
    """A ``ModelConfig`` from a config.json dict; ``default_name`` unless it has ``_name_or_path``."""
    architecture = _architecture(raw)
    family = _FAMILIES[architecture]
    if _typed(raw, "mlp_bias", bool, False):
        raise ModelConfigError("mlp_bias=true is unsupported (the engine's MLP has no biases)")
    hidden_act = _typed(raw, "hidden_act", str, "silu")
    if hidden_act != "silu":
        raise ModelConfigError(f"hidden_act {hidden_act!r} is unsupported (only 'silu')")
    hidden_size = _required_int(raw, "hidden_size")
    num_heads = _required_int(raw, "num_attention_heads")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ModelConfigError(
                f"head_dim is absent and hidden_size ({hidden_size}) is not a multiple of "
                f"num_attention_heads ({num_heads})"
            )
        head_dim = hidden_size // num_heads
    max_positions = _required_int(raw, "max_position_embeddings")
    rope_theta, rope_scaling = _rope(raw, max_positions)
    name_or_path = raw.get("_name_or_path")
    num_layers = _required_int(raw, "num_hidden_layers")
    return ModelConfig(
        architecture=architecture,
        vocab_size=_required_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_required_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_positive_int(raw, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_typed(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=_typed(raw, "tie_word_embeddings", bool, False),
        qkv_bias=family.qkv_bias(raw),
        o_bias=family.o_bias(raw),
        layer_windows=family.layer_windows(raw, num_layers),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        torch_dtype=_dtype(raw),
        model_name=name_or_path if isinstance(name_or_path, str) and name_or_path else default_name,
    )


def _architecture(raw: Mapping[str, Any]) -> Literal["llama", "mistral", "qwen2"]:
    model_type = raw.get("model_type")
    if model_type is None:
        classes = raw.get("architectures") or []
        found = [_ARCHITECTURE_CLASSES[c] for c in classes if c in _ARCHITECTURE_CLASSES]
        if not found:
            raise ModelConfigError(
                f"model_type is missing and architectures {classes!r} names none of "
                f"{sorted(_ARCHITECTURE_CLASSES)}"
            )
        model_type = found[0]
    if model_type not in _FAMILIES:
        raise ModelConfigError(f"model_type {model_type!r} is unsupported; supported: {sorted(_FAMILIES)}")
    return model_type


def _rope(raw: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling`` (``original_max_position_embeddings`` defaults
    to ``max_positions``, as transformers does)."""
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{key} must be an object or null, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise ModelConfigError(f"{key} nested per layer type is unsupported")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ModelConfigError(f"rope_theta must be a number, got {theta!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor {partial!r} is unsupported (only 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ModelConfigError(f"{key}.rope_type {rope_type!r} is unsupported; supported: default, llama3")
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
        if field not in params:
            raise ModelConfigError(f"{key}.{field} is required for rope_type 'llama3'")
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=params["factor"],
        low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_position_embeddings=params.get("original_max_position_embeddings", max_positions),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ModelConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _dtype(raw: Mapping[str, Any]) -> str:
    value = raw.get("torch_dtype", raw.get("dtype")) or "float32"
    name = str(value).removeprefix("torch.")
    if name not in ("float32", "float16", "bfloat16"):
        raise ModelConfigError(f"torch_dtype {value!r} is unsupported; supported: float32, float16, bfloat16")
    return name


def _required_int(raw: Mapping[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ModelConfigError(f"{key} is missing from config.json")
    return _positive_int(raw, key, None)


def _positive_int(raw: Mapping[str, Any], key: str, default: int | None) -> int:
    value = _typed(raw, key, int, default)
    _check_positive_int(key, value)
    return value


def _typed(raw: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    """``raw[key]`` (``default`` when absent or null) checked against ``kind``; ints pass as floats."""
    value = raw.get(key)
    if value is None:
        return default
    accepted = (int, float) if kind is float else kind
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, accepted):
        raise ModelConfigError(f"{key} must be of type {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_token_id(name: str, value: Any, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ModelConfigError(f"{name} {value!r} is not a token id below vocab_size {vocab_size}")
