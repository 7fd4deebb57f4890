"""Parsing config.json into ModelConfig: the three families, both RoPE spellings, errors naming the field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvlayer.engine.model_config import (
    ModelConfig,
    ModelConfigError,
    RopeScaling,
    load_model_config,
    parse_model_config,
)

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_config(folder: Path, raw: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_llama_fields_and_defaults(tmp_path: Path) -> None:
    cfg = load_model_config(write_config(tmp_path / "my-llama", LLAMA))
    assert cfg == ModelConfig(
        architecture="llama", vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=3,
        num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False, qkv_bias=False,
        o_bias=False, layer_windows=(None,) * 3, bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16",
        model_name="my-llama",
    )  # fmt: skip
    assert cfg.max_model_len == 4096


def test_optional_fields_fall_back() -> None:
    raw = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "rope_theta", "torch_dtype",
                                                       "eos_token_id", "bos_token_id", "model_type")}
    cfg = parse_model_config(raw)
    assert (cfg.architecture, cfg.num_kv_heads, cfg.rope_theta) == ("llama", 8, 10000.0)
    assert (cfg.torch_dtype, cfg.eos_token_ids, cfg.bos_token_id) == ("float32", (), None)


def test_name_eos_list_dtype_key_and_explicit_head_dim() -> None:
    raw = {**LLAMA, "_name_or_path": "org/model", "eos_token_id": [2, 7], "head_dim": 32, "dtype": "float16"}
    del raw["torch_dtype"]
    cfg = parse_model_config(raw)
    assert (cfg.model_name, cfg.eos_token_ids, cfg.head_dim) == ("org/model", (2, 7), 32)
    assert cfg.torch_dtype == "float16"


def test_llama_attention_bias_covers_all_four_projections() -> None:
    cfg = parse_model_config({**LLAMA, "attention_bias": True})
    assert cfg.qkv_bias and cfg.o_bias


def test_qwen2_biases_and_sliding_window_switch() -> None:
    qwen = {**LLAMA, "model_type": "qwen2", "sliding_window": 1024, "tie_word_embeddings": True}
    off = parse_model_config({**qwen, "use_sliding_window": False, "max_window_layers": 0})
    on = parse_model_config({**qwen, "use_sliding_window": True, "max_window_layers": 0})
    assert (off.qkv_bias, off.o_bias, off.tie_word_embeddings) == (True, False, True)
    assert (off.layer_windows, off.sliding_window, off.attention_reach) == ((None,) * 3, None, None)
    assert (on.layer_windows, on.sliding_window, on.attention_reach) == ((1024,) * 3, 1024, 1024)
    assert on.max_model_len == off.max_model_len == 4096  # the window no longer caps the context


def test_qwen2_layers_below_max_window_layers_stay_full() -> None:
    """transformers' Qwen2Config: layer i slides when i >= max_window_layers (default 28)."""
    qwen = {**LLAMA, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}
    assert parse_model_config({**qwen, "max_window_layers": 1}).layer_windows == (None, 64, 64)
    cfg = parse_model_config(qwen)
    assert (cfg.layer_windows, cfg.attention_reach) == ((None,) * 3, None)
    del qwen["sliding_window"]  # absent: transformers' default window of 4096
    assert parse_model_config({**qwen, "max_window_layers": 2}).layer_windows == (None, None, 4096)


def test_qwen2_layer_types_make_a_hybrid() -> None:
    qwen = {**LLAMA, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
            "max_window_layers": 0}
    types = ["full_attention", "sliding_attention", "full_attention"]
    cfg = parse_model_config({**qwen, "layer_types": types})
    assert (cfg.layer_windows, cfg.sliding_window, cfg.attention_reach) == ((None, 64, None), 64, None)
    with pytest.raises(ModelConfigError, match="no sliding_window"):
        parse_model_config({**qwen, "use_sliding_window": False, "layer_types": types})
    with pytest.raises(ModelConfigError, match="linear_attention"):
        parse_model_config({**qwen, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ModelConfigError, match="layer_types"):
        parse_model_config({**qwen, "layer_types": types[:2]})


def test_mistral_window_applies_to_every_layer() -> None:
    """transformers' Mistral slides every layer and ignores layer_types; Llama has no window at all."""
    mistral = {**LLAMA, "model_type": "mistral", "attention_bias": True}
    cfg = parse_model_config({**mistral, "sliding_window": 512, "layer_types": ["full_attention"] * 3})
    assert (cfg.layer_windows, cfg.attention_reach, cfg.max_model_len) == ((512,) * 3, 512, 4096)
    cfg = parse_model_config({**mistral, "sliding_window": None})
    assert (cfg.layer_windows, cfg.max_model_len, cfg.qkv_bias) == ((None,) * 3, 4096, False)
    assert parse_model_config(mistral).layer_windows == (4096,) * 3  # absent: transformers' default
    llama = parse_model_config({**LLAMA, "sliding_window": 64, "layer_types": ["sliding_attention"] * 3})
    assert llama.layer_windows == (None,) * 3


def test_architecture_from_class_name() -> None:
    raw = {**LLAMA, "architectures": ["Qwen2ForCausalLM"]}
    del raw["model_type"]
    assert parse_model_config(raw).architecture == "qwen2"


LLAMA3 = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "llama3", **LLAMA3}},
        {"rope_scaling": {"type": "llama3", **LLAMA3}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}, "rope_theta": None},
    ],
    ids=["rope_scaling", "legacy-type-key", "rope_parameters"],
)
def test_llama3_rope_in_every_spelling(rope: dict[str, Any]) -> None:
    cfg = parse_model_config({**LLAMA, **rope})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_rope_parameters_default_and_original_max_fallback() -> None:
    plain = parse_model_config({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)
    partial = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = parse_model_config({**LLAMA, "rope_scaling": {"rope_type": "llama3", **partial}})
    assert cfg.rope_scaling.original_max_position_embeddings == 4096


def test_transformers_round_trip_gives_the_same_config(tmp_path: Path) -> None:
    """transformers 5 rewrites rope_scaling as rope_parameters and torch_dtype as dtype."""
    transformers = pytest.importorskip("transformers")
    variants = (
        {"rope_scaling": {"rope_type": "llama3", **LLAMA3}},
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 64},
    )
    for variant in variants:
        write_config(tmp_path / "in", {**LLAMA, **variant})
        transformers.AutoConfig.from_pretrained(tmp_path / "in").save_pretrained(tmp_path / "out")
        expected = replace(load_model_config(tmp_path / "in"), model_name="out")
        assert load_model_config(tmp_path / "out") == expected


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2, "low_freq_factor": 1}}, "high_freq_factor"),
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "high_freq_factor": 0.5}}, "high_freq_factor"),
        ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": -1}}, "factor"),
        ({"rope_theta": "big"}, "rope_theta"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": "1000"}, "vocab_size"),
        ({"intermediate_size": True}, "intermediate_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 7}, "head_dim"),
        ({"head_dim": 15}, "head_dim"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"max_position_embeddings": -5}, "max_position_embeddings"),
        ({"eos_token_id": "</s>"}, "eos_token_id"),
        ({"eos_token_id": [2, 5000]}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
    ],
)
def test_bad_values_name_the_field(change: dict[str, Any], field: str) -> None:
    raw = {**LLAMA, **change}
    for key in [k for k, v in change.items() if v is None]:
        del raw[key]
    with pytest.raises(ModelConfigError, match=field):
        parse_model_config(raw)


def test_missing_folder_file_or_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        load_model_config(tmp_path / "nowhere")
    with pytest.raises(ModelConfigError, match="config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="config.json"):
        load_model_config(tmp_path)


def test_config_is_frozen() -> None:
    cfg = parse_model_config(LLAMA)
    with pytest.raises(AttributeError):
        cfg.num_layers = 4  # type: ignore[misc]
