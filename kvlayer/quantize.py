"""Lossy payload encodings of the lower tiers (``storage_quantization``): int8 and fp8 (e4m3).

A chunk ``[layers, planes, tokens, kv_heads, head_dim]`` is stored as one byte per element plus one
float32 scale per layer, K/V and head: ``scale = absmax / qmax`` over that head's tokens and
``head_dim`` (``qmax`` 127 for int8, 448 for e4m3, the largest finite ``float8_e4m3fn``), and an
element ``x`` as ``code = q(x / scale)``, read back as ``code * scale`` in the chunk's dtype.

- int8: ``q`` rounds to the nearest integer, so ``|x - code * scale| <= scale / 2`` (absmax / 254).
- fp8: ``q`` rounds to the nearest e4m3 value (3 mantissa bits): relative error at most 2^-4 for
  ``|x / scale| >= 2^-6`` (normal values), absolute error at most ``scale * 2^-10`` below
  (subnormals): ``|x - code * scale| <= max(|x| / 16, scale / 1024)``.

The encoded bytes are layer-major, like a raw chunk's: layer ``l`` is its ``2 * kv_heads`` scales
(float32 little-endian, K's heads then V's) followed by its ``2 * tokens * kv_heads * head_dim``
codes in the chunk's element order, so a layer group stays one contiguous byte range. Encoding
and decoding are whole-chunk torch operations (no loop over layers or heads). A head whose
values are all zero gets scale 0 and decodes to zeros, exactly.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from kvlayer.config import QUANTIZATIONS as CONFIG_QUANTIZATIONS

_SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class Quantizer(abc.ABC):
    """One encoding: its name (the config value), header code and largest code magnitude."""

    name: str
    code: int
    qmax: float

    @abc.abstractmethod
    def to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """``scaled`` (float32, within ``[-qmax, qmax]`` up to rounding; may be overwritten) as
        one-byte codes."""

    @abc.abstractmethod
    def from_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(values, unit)``: one-byte ``codes`` (a uint8 tensor) are worth ``values * unit``
        (``values`` float32, new memory)."""

    @abc.abstractmethod
    def _bound(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The error bound of each of ``x`` under ``scale`` (which broadcasts to ``x``)."""

    def encoded_len(self, shape: tuple[int, ...]) -> int:
        """Bytes of the encoding of a chunk of ``shape`` ``[layers, planes, tokens, kv_heads, head_dim]``."""
        layers, kv, tokens, heads, dim = shape
        return layers * kv * heads * (_SCALE_BYTES + tokens * dim)

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        """The encoding of a host ``chunk`` (5-d, float dtype) as a new contiguous uint8 tensor
        ``[layers, bytes per layer]``. ValueError if the chunk holds a NaN or an infinity."""
        layers, kv, tokens, heads, dim = chunk.shape
        # [layers * 2, tokens, heads * dim]: the scales broadcast over the middle dimension only,
        # which torch runs several times faster than the 5-d broadcast
        x = chunk.float().reshape(layers * kv, tokens, heads * dim)
        absmax = torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_()).view(layers * kv, heads, dim).amax(dim=2)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("a chunk with NaN or infinite KV cannot be quantized")
        inv = torch.where(absmax > 0, self.qmax / absmax, torch.zeros_like(absmax))
        codes = self.to_codes(x * inv.repeat_interleave(dim, dim=1).unsqueeze(1))
        scale = (absmax / self.qmax).view(layers, kv * heads)
        return torch.cat([scale.view(torch.uint8), codes.view(torch.uint8).view(layers, -1)], dim=1)

    def decode(self, data: torch.Tensor, out: torch.Tensor) -> None:
        """Write the chunk encoded in ``data`` (uint8, ``encoded_len(out.shape)`` bytes) into the
        contiguous host tensor ``out``, in ``out``'s dtype. ValueError if the length does not fit."""
        layers, kv, tokens, heads, dim = out.shape
        if data.numel() != self.encoded_len(tuple(out.shape)):
            raise ValueError(f"{data.numel()} bytes do not encode a {tuple(out.shape)} chunk")
        rows = data.view(layers, -1)
        scales = rows[:, : kv * heads * _SCALE_BYTES].contiguous().view(torch.float32).view(layers * kv, heads)
        values, unit = self.from_codes(rows[:, kv * heads * _SCALE_BYTES :].reshape(layers * kv, tokens, heads * dim))
        factors = (scales * unit).repeat_interleave(dim, dim=1).unsqueeze(1)
        if out.dtype == torch.float32:
            torch.mul(values, factors, out=out.view(layers * kv, tokens, heads * dim))
        else:
            out.copy_(values.mul_(factors).view(out.shape))

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        """Per element of ``chunk``, the largest error its encoding may make (float32, see above)."""
        x = chunk.float()
        return self._bound(x, x.abs().amax(dim=(2, 4), keepdim=True) / self.qmax)


class Int8(Quantizer):
    """Symmetric int8: codes -127..127, rounded to nearest."""

    def to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-127, 127).to(torch.int8)

    def from_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, float]:
        return codes.view(torch.int8).float(), 1.0

    def _bound(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (scale / 2).expand_as(x)


class Fp8E4M3(Quantizer):
    """fp8 e4m3 (``torch.float8_e4m3fn``, no infinities): clamped to +-448, rounded to nearest."""

    def to_codes(self, scaled: torch.Tensor) -> torch.Tensor:
        # e4m3fn has no infinity: a value rounding past 448 would become NaN, so clamp first
        return scaled.clamp_(-self.qmax, self.qmax).to(torch.float8_e4m3fn)

    def from_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, float]:
        # torch's float8 -> float32 cast is scalar code (several times slower here). An e4m3
        # byte's exponent and mantissa bits, shifted into the low exponent bits and top mantissa
        # bits of a float16, with its sign on top, are the float16 of its value / 2^8, subnormals
        # included (the biases differ by 8); float16 -> float32 is vectorized. The byte is
        # sign-extended, so after the shift bit 15 is the sign and bit 14 (cleared) a copy of it.
        # Only NaN (never written) decodes differently.
        half = (codes.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~0x4000)
        return half.view(torch.float16).float(), 256.0

    def _bound(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x.abs() / 16, scale / 1024)


QUANTIZERS: dict[str, Quantizer] = {"int8": Int8("int8", 1, 127.0), "fp8": Fp8E4M3("fp8", 2, 448.0)}
"""Encoding name -> its quantizer (the chunk header stores ``code``; 0 is an exact payload)."""
QUANTIZATIONS: tuple[str, ...] = ("none", *QUANTIZERS)
assert QUANTIZATIONS == CONFIG_QUANTIZATIONS, "kvlayer.config lists the quantizations this module implements"
"""The values of ``storage_quantization``: ``none`` (exact, the default) or a ``QUANTIZERS`` name."""
