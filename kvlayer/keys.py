"""Chunk keys: chained cryptographic hashes of token chunks under a namespace.

``chunk_hash[i] = blake2b(chunk_hash[i-1] || tokens[i*C:(i+1)*C] as little-endian int32)``
with ``chunk_hash[-1] = blake2b(namespace)`` (docs/architecture.md section 3). Keys are identical
across processes, restarts and machines: nothing here depends on Python's ``hash``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvlayer.config import QUANTIZATIONS
from kvlayer.layout import DEFAULT_CACHE_LAYOUT, KVLayout, WindowGroup, dtype_name

FORMAT_VERSION = 1
"""Bumped whenever the chunk layout or the on-disk/in-Redis format changes."""

KEY_BYTES = 32
TOKENS_DIGEST_BYTES = 16
TENANT_BYTES = 8
DEFAULT_TENANT = bytes(TENANT_BYTES)
"""The tenant tag of the empty salt (``tenant_tag("")``)."""


def tenant_tag(salt: str) -> bytes:
    """The ``TENANT_BYTES`` tag of ``cache_salt`` ``salt`` that a cache server accounts quotas by:
    a personalised blake2b of it (the salt itself never leaves the process); the empty salt's
    tag is ``DEFAULT_TENANT``."""
    if not salt:
        return DEFAULT_TENANT
    return hashlib.blake2b(salt.encode(), digest_size=TENANT_BYTES, person=b"kvlayer.tenant").digest()


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two requests to share a chunk.

    ``model_fingerprint`` identifies weights and config (the engine computes it); ``salt`` is
    the tenant's ``cache_salt`` ("" for none); ``quantization`` the instance's
    ``storage_quantization``: an instance that keeps lossy chunks in its lower tiers has keys of
    its own, so exact and quantized chunks are never served for one another.
    """

    model_name: str
    model_fingerprint: str
    layout: KVLayout
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    salt: str = ""
    format_version: int = FORMAT_VERSION
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")

    def with_salt(self, salt: str | None) -> Namespace:
        """The same namespace for another tenant (``None`` keeps this one's salt)."""
        if salt is None or salt == self.salt:
            return self
        return dataclasses.replace(self, salt=salt)

    def describe(self) -> bytes:
        """A canonical, unambiguous byte string of every field (fields are length-prefixed)."""
        lay = self.layout
        fields = (
            "kvlayer", str(self.format_version), self.model_name, self.model_fingerprint,
            dtype_name(lay.dtype), str(lay.num_layers), str(lay.num_kv_heads), str(lay.head_dim),
            str(self.chunk_size), str(self.tp_rank), str(self.tp_size), self.salt,
        )
        if lay.cache_layout != DEFAULT_CACHE_LAYOUT:  # the default's keys stay those of format 1
            fields += (lay.cache_layout,)
        if self.quantization != "none":  # likewise; tagged, so it never reads as a cache layout
            fields += (f"storage:{self.quantization}",)
        out = bytearray()
        for f in fields:
            b = f.encode()
            out += struct.pack("<I", len(b)) + b
        return bytes(out)

    def root(self) -> bytes:
        """``chunk_hash[-1]``: the hash of the namespace."""
        return hashlib.blake2b(self.describe(), digest_size=KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One chunk of a token sequence: tokens ``[start, end)``, its chained key and tokens digest.

    ``layers`` ``()``: the chunk holds every layer's KV. Otherwise it is the KV of those model
    layers only (a layer group's object of a hybrid model, ``group_key``), shaped
    ``[len(layers), planes, tokens, kv_heads, head_dim]``, under a digest of its own.
    """

    digest: bytes
    tokens_digest: bytes
    start: int
    end: int
    layers: tuple[int, ...] = ()
    tenant: bytes = dataclasses.field(default=DEFAULT_TENANT, compare=False)
    """``tenant_tag`` of the namespace's salt (a cache server's quotas); not part of equality."""

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes; ValueError for ids outside int32."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in [0, 2**31)")
    return arr.astype("<i4").tobytes()


def chunk_keys(namespace: Namespace, token_ids: Sequence[int], include_partial: bool = False,
               prefix: Sequence[ChunkKey] = ()) -> list[ChunkKey]:
    """Keys of the chunks of ``token_ids``: every full chunk, plus the last partial one if asked.

    ``prefix`` may hold already computed keys of a leading part of the same tokens (from an
    earlier call), which are reused instead of rehashed.
    """
    size = namespace.chunk_size
    n = len(token_ids)
    keys = []
    for k in prefix[: n // size]:  # only full chunks carry over: a partial tail may have grown
        if k.num_tokens != size or k.start != len(keys) * size:
            break
        keys.append(k)
    prev = keys[-1].digest if keys else namespace.root()
    tenant = tenant_tag(namespace.salt)
    data = tokens_bytes(token_ids)
    start = len(keys) * size
    while start < n:
        end = min(start + size, n)
        if end - start < size and not include_partial:
            break
        tok = data[start * 4 : end * 4]
        digest = hashlib.blake2b(prev + tok, digest_size=KEY_BYTES).digest()
        keys.append(ChunkKey(digest, hashlib.blake2b(tok, digest_size=TOKENS_DIGEST_BYTES).digest(),
                             start, end, tenant=tenant))
        prev = digest
        start = end
    return keys


def group_key(key: ChunkKey, group: WindowGroup, num_layers: int) -> ChunkKey:
    """The key of ``group``'s share of chunk ``key`` (a chunk of all ``num_layers`` layers): ``key``
    itself when the group holds every layer, else a key whose digest is
    ``blake2b("kvlayer.layers" || key.digest || the layer indices as u16)``. The chain goes on
    through ``key``, so group keys are leaves: any instance computes them from the tokens."""
    if len(group.layers) == num_layers:
        return key
    tag = b"kvlayer.layers\0" + key.digest + struct.pack(f"<{len(group.layers)}H", *group.layers)
    return ChunkKey(hashlib.blake2b(tag, digest_size=KEY_BYTES).digest(), key.tokens_digest, key.start, key.end,
                    group.layers, key.tenant)
