"""MLA-shaped KV (``kvlayer.layout.LATENT_CACHE_LAYOUT``): one latent vector per token and layer,
no K/V split, no heads. Chunks ``[layers, 1, tokens, 1, latent_dim]`` round-trip exactly through
``KVCacheEngine`` and each tier (the Triton kernel copies them as the torch path does:
tests/kernels/test_latent_kernels.py), and are never read under a K/V layout's keys or shape (docs/heterogeneous.md)."""

from __future__ import annotations

import pytest
import torch

from kvlayer import transfer
from kvlayer.cache_engine import KVCacheEngine
from kvlayer.keys import Namespace, chunk_keys
from kvlayer.layout import DEFAULT_CACHE_LAYOUT, LATENT_CACHE_LAYOUT, KVLayout
from kvlayer.serde import ChunkFormatError, check_header, decode_header, encode_chunk

LAYERS, BLOCKS, BLOCK, LATENT = 3, 12, 16, 72  # DeepSeek's latent is 512 + 64 wide; 72 keeps it small
CHUNK = 32
MLA = KVLayout(LAYERS, 1, LATENT, torch.float32, BLOCK, LATENT_CACHE_LAYOUT)


def latent_caches(seed: int | None) -> list[torch.Tensor]:
    """vLLM's MLA caches, ``[num_blocks, block_size, latent_dim]`` per layer (zeros without a seed)."""
    if seed is None:
        return [torch.zeros(BLOCKS, BLOCK, LATENT) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, BLOCK, LATENT, generator=gen) for _ in range(LAYERS)]


def rows(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.view(-1, LATENT)[slots] for c in caches])


def test_the_latent_layout_has_one_plane_and_one_head() -> None:
    assert (MLA.latent, MLA.planes, MLA.opaque_blocks, MLA.copy_unit) == (True, 1, False, 1)
    assert MLA.chunk_shape(CHUNK) == (LAYERS, 1, CHUNK, 1, LATENT)
    assert MLA.bytes_per_token == LAYERS * LATENT * 4  # half a K/V layout's of the same width
    assert KVLayout(LAYERS, 1, LATENT, torch.float32, BLOCK).bytes_per_token == 2 * MLA.bytes_per_token
    cache = latent_caches(0)[0]
    view = MLA.paged_view(cache)
    assert view.shape == (1, BLOCKS, BLOCK, 1, LATENT) and view.data_ptr() == cache.data_ptr()
    with pytest.raises(ValueError, match="num_kv_heads must be 1, got 4"):
        KVLayout(LAYERS, 4, LATENT, torch.float32, BLOCK, LATENT_CACHE_LAYOUT)
    with pytest.raises(ValueError, match="does not fit"):
        MLA.paged_view(torch.zeros(BLOCKS, BLOCK, LATENT + 1))


@pytest.mark.parametrize("tiers", ["cpu", "nvme", "nvme-int8"])
def test_latent_chunks_round_trip_through_each_tier(tmp_path, tiers: str) -> None:
    config: dict = {"chunk_size": CHUNK, "cpu_capacity": "8MiB" if tiers == "cpu" else 0}
    if tiers.startswith("nvme"):
        config |= {"nvme_path": str(tmp_path / "kv"), "nvme_capacity": "64MiB"}
    if tiers == "nvme-int8":
        config["storage_quantization"] = "int8"
    tokens = list(range(100, 100 + 3 * CHUNK + 5))
    src = latent_caches(1)
    src_slots = transfer.slot_mapping(torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(2)).tolist(),
                                      BLOCK, 0, len(tokens))
    with KVCacheEngine(config, MLA, model_name="mla") as kv:
        assert kv.store(tokens, [MLA.paged_view(c) for c in src], src_slots) == 3
        assert kv.flush()
        if tiers.startswith("nvme"):
            files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.stat().st_size > 4096]
            assert len(files) == 3
        dst = latent_caches(None)
        dst_slots = transfer.slot_mapping(list(range(BLOCKS - 1, -1, -1)), BLOCK, 0, len(tokens))
        assert kv.lookup(tokens).num_tokens == 3 * CHUNK
        assert kv.retrieve(tokens, [MLA.paged_view(c) for c in dst], dst_slots) == 3 * CHUNK
    want, got = rows(src, src_slots[: 3 * CHUNK]), rows(dst, dst_slots[: 3 * CHUNK])
    if tiers == "nvme-int8":
        per_chunk = want.view(LAYERS, 3, CHUNK, LATENT)  # one scale per chunk and layer (the one "head")
        bound = per_chunk.abs().amax(dim=(2, 3), keepdim=True) / 254 + 1e-7
        assert ((got.view_as(per_chunk) - per_chunk).abs() <= bound).all() and not torch.equal(got, want)
    else:
        assert torch.equal(got, want)
    assert not rows(dst, dst_slots[3 * CHUNK :]).any()  # the partial tail was not stored


def test_latent_chunks_are_never_read_as_kv_chunks(tmp_path) -> None:
    kv_layout = KVLayout(LAYERS, 1, LATENT // 2, torch.float32, BLOCK, DEFAULT_CACHE_LAYOUT)  # the same bytes
    assert kv_layout.bytes_per_token == MLA.bytes_per_token
    tokens = list(range(2 * CHUNK))
    mla_keys = chunk_keys(Namespace("m", "f", MLA, CHUNK), tokens)
    kv_keys = chunk_keys(Namespace("m", "f", kv_layout, CHUNK), tokens)
    assert not {k.digest for k in mla_keys} & {k.digest for k in kv_keys}  # the namespace differs
    # the same folder and model: the K/V instance finds nothing the MLA one stored
    config = {"chunk_size": CHUNK, "cpu_capacity": 0, "nvme_path": str(tmp_path), "nvme_capacity": "64MiB"}
    src = latent_caches(3)
    slots = transfer.slot_mapping(list(range(BLOCKS)), BLOCK, 0, len(tokens))
    with KVCacheEngine(config, MLA, model_name="m", model_fingerprint="f") as kv:
        kv.store(tokens, [MLA.paged_view(c) for c in src], slots)
        kv.flush()
    with KVCacheEngine(config, kv_layout, model_name="m", model_fingerprint="f") as kv:
        assert kv.lookup(tokens).num_tokens == 0
    # and bytes forged under a K/V key are refused by their shape, before any is used
    chunk = rows(src, slots[:CHUNK]).view(LAYERS, 1, CHUNK, 1, LATENT)
    header, _ = encode_chunk(kv_keys[0], chunk)
    with pytest.raises(ChunkFormatError, match="shape"):
        check_header(decode_header(header), kv_keys[0], kv_layout.chunk_shape(CHUNK), torch.float32)
    check_header(decode_header(header), kv_keys[0], MLA.chunk_shape(CHUNK), torch.float32)

