"""The chunk format on disk and in Redis: a versioned ``struct`` header, then the payload.

Header (little-endian, ``HEADER_SIZE`` bytes)::

    magic b"KVLC" | version u16 | compression u16 | key 32s | tokens_digest 16s
    | dtype u8 | ndim u8 | quantization u16 | shape 5 x u32 | raw_len u64 | payload_len u64
    | payload_xxh3 u64 | header_xxh3 u64 (of every header byte before it)

The payload is the chunk tensor's bytes (``raw_len``), or with quantization 1 (int8) or 2 (fp8
e4m3) their ``kvlayer.quantize`` encoding (scales and one-byte codes), then lz4-compressed when
compression is 1 (``payload_len`` stored bytes). ``dtype`` and ``shape`` are the chunk's own,
what a quantized payload decodes to. The quantization field was padding (always 0) before, so
older chunks read as exact ones. Readers parse only this format (never pickle): any mismatch
(magic, version, key, tokens digest, dtype, shape, payload encoding, lengths, checksums) raises
``ChunkFormatError``, which callers turn into a miss and a counter.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvlayer.keys import FORMAT_VERSION, KEY_BYTES, TOKENS_DIGEST_BYTES, ChunkKey
from kvlayer.quantize import QUANTIZERS

MAGIC = b"KVLC"
_HEAD = struct.Struct(f"<4sHH{KEY_BYTES}s{TOKENS_DIGEST_BYTES}sBBH5IQQQ")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _HEAD.size + _CHECK.size

COMPRESSION_CODES = {"none": 0, "lz4": 1}
QUANTIZATION_CODES = {"none": 0, **{q.name: q.code for q in QUANTIZERS.values()}}
_CODE_QUANTIZERS = {q.code: q for q in QUANTIZERS.values()}
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class ChunkFormatError(ValueError):
    """Stored bytes are not a valid chunk for the requested key."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A parsed header; ``shape`` is the chunk's ``[layers, planes, tokens, kv_heads, head_dim]``."""

    compression: int
    key: bytes
    tokens_digest: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]
    raw_len: int
    payload_len: int
    payload_checksum: int
    quantization: int = 0

    @property
    def raw(self) -> bool:
        """Whether the payload is the chunk's own bytes (neither quantized nor compressed), so
        that a read can land it in place, layer range by layer range."""
        return self.compression == 0 and self.quantization == 0

    @property
    def encoded_len(self) -> int:
        """Bytes of the payload before compression: the raw chunk's, or its quantized encoding's."""
        q = _CODE_QUANTIZERS.get(self.quantization)
        return self.raw_len if q is None else q.encoded_len(self.shape)


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: ChunkKey, tensor: torch.Tensor, payload: bytes | memoryview, compression: str,
                  quantization: str = "none") -> bytes:
    """The header for ``tensor`` stored as ``payload`` (its raw or quantized bytes, or their lz4 form)."""
    if tensor.dim() != 5:
        raise ValueError(f"a chunk has 5 dimensions, got shape {tuple(tensor.shape)}")
    raw_len = tensor.numel() * tensor.element_size()
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, COMPRESSION_CODES[compression], key.digest, key.tokens_digest,
                      _DTYPE_CODES[tensor.dtype], 5, QUANTIZATION_CODES[quantization], *tensor.shape, raw_len,
                      len(payload), payload_checksum(payload))
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def encode_payload(tensor: torch.Tensor, compression: str, quantization: str = "none") -> bytes | memoryview:
    """The stored payload of a host tensor: a zero-copy view of its bytes (or of its quantized
    encoding, new memory the view keeps alive), or their lz4 frame."""
    data = tensor.contiguous() if quantization == "none" else QUANTIZERS[quantization].encode(tensor)
    raw = memoryview(data.view(-1).view(torch.uint8).numpy())
    if compression == "none":
        return raw
    import lz4.frame

    return lz4.frame.compress(raw, compression_level=0)


def encode_chunk(key: ChunkKey, tensor: torch.Tensor, compression: str = "none",
                 quantization: str = "none") -> tuple[bytes, bytes | memoryview]:
    """``(header, payload)`` for a host chunk tensor; write them back to back. ``quantization``
    other than none is lossy (``kvlayer.quantize``; ValueError for a chunk with NaN or inf)."""
    payload = encode_payload(tensor, compression, quantization)
    return encode_header(key, tensor, payload, compression, quantization), payload


def decode_header(data: bytes | memoryview) -> ChunkHeader:
    """Parse and check the header at the start of ``data``; ChunkFormatError if it is not one."""
    if len(data) < HEADER_SIZE:
        raise ChunkFormatError(f"truncated header: {len(data)} < {HEADER_SIZE} bytes")
    head = bytes(data[: _HEAD.size])
    (check,) = _CHECK.unpack_from(data, _HEAD.size)
    if xxhash.xxh3_64_intdigest(head) != check:
        raise ChunkFormatError("header checksum mismatch")
    magic, version, comp, key, tdig, dcode, ndim, quant, *rest = _HEAD.unpack(head)
    shape, (raw_len, payload_len, pchk) = tuple(rest[:5]), rest[5:]
    if magic != MAGIC:
        raise ChunkFormatError("bad magic")
    if version != FORMAT_VERSION:
        raise ChunkFormatError(f"format version {version}, expected {FORMAT_VERSION}")
    if comp not in COMPRESSION_CODES.values():
        raise ChunkFormatError(f"unknown compression code {comp}")
    if quant not in QUANTIZATION_CODES.values():
        raise ChunkFormatError(f"unknown quantization code {quant}")
    if dcode not in _CODE_DTYPES or ndim != 5:
        raise ChunkFormatError(f"bad dtype code {dcode} or ndim {ndim}")
    dtype = _CODE_DTYPES[dcode]
    numel = 1
    for s in shape:
        numel *= s
    if raw_len != numel * torch.empty((), dtype=dtype).element_size():
        raise ChunkFormatError("raw length does not match shape")
    header = ChunkHeader(comp, key, tdig, dtype, shape, raw_len, payload_len, pchk, quant)
    if comp == 0 and payload_len != header.encoded_len:
        raise ChunkFormatError("payload length does not match the chunk's length")
    return header


def check_header(header: ChunkHeader, key: ChunkKey, shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype | None = None, quantization: str = "none") -> None:
    """ChunkFormatError unless the header is for ``key`` (and ``shape``/``dtype`` when given) and
    its payload is encoded as ``quantization`` says: a reader of exact chunks never takes a
    quantized one, nor a quantized reader one of another encoding."""
    if header.key != key.digest or header.tokens_digest != key.tokens_digest:
        raise ChunkFormatError(f"chunk holds another key than {key.hex[:16]}")
    if header.quantization != QUANTIZATION_CODES[quantization]:
        raise ChunkFormatError(f"payload quantization code {header.quantization}, expected {quantization!r}")
    if shape is not None and tuple(shape) != header.shape:
        raise ChunkFormatError(f"shape {header.shape}, expected {tuple(shape)}")
    if dtype is not None and dtype != header.dtype:
        raise ChunkFormatError(f"dtype {header.dtype}, expected {dtype}")


def decode_payload(header: ChunkHeader, payload: bytes | memoryview, out: torch.Tensor) -> None:
    """Verify ``payload`` and write the chunk into ``out`` (a host tensor of the header's shape)."""
    if len(payload) != header.payload_len:
        raise ChunkFormatError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    if payload_checksum(payload) != header.payload_checksum:
        raise ChunkFormatError("payload checksum mismatch")
    if tuple(out.shape) != header.shape or out.dtype != header.dtype:
        raise ChunkFormatError("output tensor does not match the header")
    if header.compression == COMPRESSION_CODES["lz4"]:
        payload = _lz4_decompress(payload, header.encoded_len)
    quantizer = _CODE_QUANTIZERS.get(header.quantization)
    if quantizer is not None:
        # torch tensors over read-only memory warn; a private copy of the codes costs a quarter
        # of the chunk's bytes (float32) at most
        data = payload if not memoryview(payload).readonly else bytearray(payload)
        quantizer.decode(torch.frombuffer(data, dtype=torch.uint8), out)
        return
    np.copyto(out.view(-1).view(torch.uint8).numpy(), np.frombuffer(payload, dtype=np.uint8))


def _lz4_decompress(payload: bytes | memoryview, raw_len: int) -> bytes:
    """Exactly one lz4 frame of ``raw_len`` bytes (the payload before compression), or ChunkFormatError.

    The output is bounded by ``raw_len``: ``lz4.frame.decompress`` trusts the content size in
    the frame header and raised MemoryError (or allocated that much) for a forged one.
    """
    import lz4.frame

    dec = lz4.frame.LZ4FrameDecompressor()
    try:
        raw = dec.decompress(payload, max_length=raw_len)
    except RuntimeError as e:
        raise ChunkFormatError(f"lz4: {e}") from e
    if len(raw) != raw_len or not dec.eof or dec.unused_data:
        raise ChunkFormatError("lz4 payload does not hold exactly the chunk")
    return raw
