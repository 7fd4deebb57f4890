"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

``CausalLM(config, dtype, device)`` builds the network with uninitialised weights under the
Hugging Face parameter names (``model.layers.N.self_attn.q_proj.weight`` ...), so
``loader.load_model`` fills it straight from a checkpoint. One ``forward`` runs a whole engine
step (decodes and prefill spans flattened into one batch, see ``attention_metadata``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from kvlayer.engine.attention import paged_attention, write_kv
from kvlayer.engine.attention_metadata import AttentionMetadata, LayerHooks
from kvlayer.engine.model_config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled by ``weight`` in the input dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    return skip_init(nn.Linear, n_in, n_out, bias=bias, dtype=dtype, device=device)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; reads and writes one layer's paged KV cache.
    ``window``: the layer's sliding window (None: full attention)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = _linear(config.hidden_size, q_size, config.qkv_bias, dtype, device)
        self.k_proj = _linear(config.hidden_size, kv_size, config.qkv_bias, dtype, device)
        self.v_proj = _linear(config.hidden_size, kv_size, config.qkv_bias, dtype, device)
        self.o_proj = _linear(q_size, config.hidden_size, config.o_bias, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        hooks: LayerHooks,
        layer: int,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = _rotate(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        hooks.before_attention(layer)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        hooks.after_attention(layer, kv_cache)
        return self.o_proj(out.view(tokens, self.num_heads * self.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[T, heads, D]`` with ``cos``/``signed_sin`` ``[T, 1, D]`` (halves layout:
    ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``; the sign lives in the table)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, False, dtype, device)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, False, dtype, device)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.gate_proj(x))
        return self.down_proj(gate.mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device, config.layer_windows[layer])
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """A decoder-only language model running engine steps over a paged KV cache.

    Parameters are allocated uninitialised (fill them with ``loader.load_model``); the module
    is in eval mode with gradients off. The RoPE ``cos``/``sin`` tables cover positions
    ``[0, config.max_model_len)`` and live on ``device`` in ``dtype`` (the sine negated on the
    first half of each head, for ``_rotate``).
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.model = Backbone(config, dtype, device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _linear(config.hidden_size, config.vocab_size, False, dtype, device)
        )
        cos, sin = rope_tables(config, device)
        half = config.head_dim // 2
        sin[:, :half].neg_()
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_signed_sin", sin.to(dtype), persistent=False)
        self.requires_grad_(False)
        self.eval()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        hooks: LayerHooks,
    ) -> torch.Tensor:
        """Run one step: ``input_ids``/``positions`` ``[T]`` int64 (positions below
        ``config.max_model_len``) -> final-normed hidden states ``[T, hidden]``.

        ``kv_caches[i]`` is layer ``i``'s contiguous cache ``[2, num_blocks, block_size,
        num_kv_heads, head_dim]``; each token's key/value is written at ``meta.slot_mapping``
        before ``hooks.before_attention(i)``, and ``hooks.after_attention(i, kv_caches[i])``
        follows that layer's attention.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches, got {len(kv_caches)}")
        hidden = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_signed_sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn(layer.input_layernorm(hidden), cos, sin, meta, kv_caches[i], hooks, i)
            hidden += attn
            hidden += layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits, float32 ``[N, vocab]``, of final hidden states ``[N, hidden]``."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` float32, with ``config.rope_scaling`` applied."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is None or config.rope_scaling.rope_type == "default":
        return inv_freq
    return _llama3_scale(inv_freq, config.rope_scaling)


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a linear blend between."""
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_limit = original / scaling.low_freq_factor
    short_limit = original / scaling.high_freq_factor
    blend = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    scaled = torch.where(wavelength > long_limit, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < short_limit, inv_freq, scaled)


def rope_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` ``[max_model_len, head_dim]``, halves layout (each angle twice)."""
    inv_freq = inverse_frequencies(config).to(device)
    angles = torch.outer(torch.arange(config.max_model_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()
