"""``storage_quantization`` through ``KVCacheEngine``: int8/fp8 chunks in NVMe and Redis.

Round trips within the error bound, a quarter of the bytes, an exact CPU tier, instances of
different encodings never sharing a chunk, a corrupted quantized chunk a counted miss, and a bad
value refused. Redis cases use a throwaway ``redis-server`` (skipped without the binary). Run:
``.venv/bin/python -m pytest tests/kvlayer/test_quantized_storage.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvlayer import ConfigError, KVCacheEngine, KVLayerConfig
from kvlayer.backends.redis_pairs import chunk_names
from kvlayer.serde import HEADER_SIZE
from tests.backends.conftest import redis_server  # noqa: F401  (the fixture)
from tests.kvlayer.test_cache_engine import LAYOUT, caches, kv_at, slots_for
from tests.kvlayer.test_quantize import SLACK, error_bound

CHUNK = 8
TOKENS = list(range(300, 332))
"""Four chunks."""
RAW_PAYLOAD = LAYOUT.chunk_bytes(CHUNK)
QUANT_PAYLOAD = LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * (4 + CHUNK * LAYOUT.head_dim)
TIERS = ["nvme", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture
def place(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The settings of the lower tier ``request.param`` names (NVMe in a tmp dir, or a fresh Redis)."""
    if request.param == "nvme":
        return {"nvme_path": str(tmp_path / "nvme")}
    return {"redis_url": request.getfixturevalue("redis_server").url}


def engine(place: dict[str, Any], quantization: str, cpu: int | str = 0) -> KVCacheEngine:
    config = {"chunk_size": CHUNK, "cpu_capacity": cpu, "storage_quantization": quantization, **place}
    return KVCacheEngine(config, LAYOUT, model_name="m", model_fingerprint="f")


def lower(place: dict[str, Any]) -> str:
    return "nvme" if "nvme_path" in place else "redis"


def stored_sizes(place: dict[str, Any], kv: KVCacheEngine) -> list[int]:
    """Bytes each of ``TOKENS``' chunks takes in the lower tier (file, or head + body values)."""
    keys = kv.keys(TOKENS)
    if lower(place) == "nvme":
        files = {p.name.split("-")[0]: p.stat().st_size for p in Path(place["nvme_path"]).rglob("*.kvc")}
        return [files[k.hex] for k in keys]
    client = redis.Redis.from_url(place["redis_url"])
    try:
        return [sum(client.strlen(n) for n in chunk_names(b"kvlayer:", k)) for k in keys]
    finally:
        client.close()


def assert_within_bound(got: torch.Tensor, want: torch.Tensor, quantization: str) -> None:
    """``got`` is ``want`` (``[layers, 2, tokens, heads, dim]``) stored chunk by chunk, lossy."""
    for start in range(0, want.shape[2], CHUNK):
        w, g = want[:, :, start : start + CHUNK], got[:, :, start : start + CHUNK]
        assert ((g - w).abs() <= error_bound(w, quantization) * SLACK).all(), f"chunk at {start}"
    assert not torch.equal(got, want), "lossy: the bound above must be what lets it pass"


def store_and_flush(kv: KVCacheEngine, src: list[torch.Tensor], slots: torch.Tensor) -> None:
    assert kv.store(TOKENS, src, slots) == len(TOKENS) // CHUNK
    assert kv.flush(timeout=60)


@pytest.mark.parametrize("place", TIERS, indirect=True)
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_round_trip_stays_within_the_bound(place: dict[str, Any], quantization: str) -> None:
    src, src_slots, dst, dst_slots = caches(), slots_for(32, 1), caches(fill=False), slots_for(32, 2)
    with engine(place, quantization) as kv:
        store_and_flush(kv, src, src_slots)
        assert kv.lookup(TOKENS).num_tokens == 32
        assert kv.retrieve(TOKENS, dst, dst_slots) == 32
        assert_within_bound(kv_at(dst, dst_slots), kv_at(src, src_slots), quantization)
        assert kv.stats()["tiers"][lower(place)]["hit_tokens"] == 32


@pytest.mark.parametrize("place", TIERS, indirect=True)
def test_a_quantized_chunk_takes_about_a_quarter_of_the_bytes(place: dict[str, Any]) -> None:
    sizes = {}
    for quantization in ("none", "int8", "fp8"):
        with engine(place, quantization) as kv:
            store_and_flush(kv, caches(), slots_for(32, 3))
            sizes[quantization] = stored_sizes(place, kv)
    assert sizes["none"] == [HEADER_SIZE + RAW_PAYLOAD] * 4
    assert sizes["int8"] == sizes["fp8"] == [HEADER_SIZE + QUANT_PAYLOAD] * 4
    scales = LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * 4  # a float32 per layer, K/V and head
    assert sizes["int8"][0] - HEADER_SIZE == RAW_PAYLOAD // 4 + scales, "a byte per float32 value, and the scales"


@pytest.mark.parametrize("place", TIERS, indirect=True)
def test_the_cpu_tier_keeps_exact_chunks(place: dict[str, Any]) -> None:
    src, src_slots, dst, dst_slots = caches(), slots_for(32, 4), caches(fill=False), slots_for(32, 5)
    with engine(place, "int8", cpu="1MiB") as kv:
        store_and_flush(kv, src, src_slots)
        assert kv.retrieve(TOKENS, dst, dst_slots) == 32
        assert torch.equal(kv_at(dst, dst_slots), kv_at(src, src_slots)), "a CPU hit of a chunk stored here is exact"
        assert kv.stats()["tiers"]["cpu"]["hit_tokens"] == 32
        kv.evict_all("cpu")  # now only the quantized copy is left
        assert kv.retrieve(TOKENS, dst, dst_slots) == 32
        assert kv.stats()["tiers"][lower(place)]["hit_tokens"] == 32
        from_lower = kv_at(dst, dst_slots).clone()
        assert_within_bound(from_lower, kv_at(src, src_slots), "int8")
        assert kv.flush(timeout=60)
        assert kv.stats()["tiers"]["cpu"]["promotions"] == 4
        again = caches(fill=False)
        assert kv.retrieve(TOKENS, again, dst_slots) == 32
        assert kv.stats()["tiers"]["cpu"]["hit_tokens"] == 64
        assert torch.equal(kv_at(again, dst_slots), from_lower), "a promoted chunk holds the dequantized values"


@pytest.mark.parametrize("place", TIERS, indirect=True)
def test_exact_and_quantized_instances_never_serve_each_other(place: dict[str, Any]) -> None:
    src, slots, dst = caches(), slots_for(32, 6), caches(fill=False)
    with engine(place, "none") as exact:
        store_and_flush(exact, src, slots)
        exact_keys = {k.digest for k in exact.keys(TOKENS)}
    with engine(place, "int8") as int8:
        assert not exact_keys & {k.digest for k in int8.keys(TOKENS)}
        assert int8.lookup(TOKENS).num_tokens == 0, "exact chunks are not served to a quantized instance"
        store_and_flush(int8, src, slots)
        assert int8.retrieve(TOKENS, dst, slots) == 32
        assert_within_bound(kv_at(dst, slots), kv_at(src, slots), "int8")
    with engine(place, "fp8") as fp8:
        assert fp8.lookup(TOKENS).num_tokens == 0, "nor int8 chunks to an fp8 one"
    with engine(place, "none") as exact:
        assert exact.lookup(TOKENS).num_tokens == 32
        assert exact.retrieve(TOKENS, dst, slots) == 32
        assert torch.equal(kv_at(dst, slots), kv_at(src, slots)), "quantized chunks are not served to an exact one"
        assert exact.stats()["tiers"][lower(place)]["backend"]["checksum_errors"] == 0


def corrupt(place: dict[str, Any], kv: KVCacheEngine, chunk: int, offset: int) -> None:
    """Flip one bit of payload byte ``offset`` (in the scales when small) of chunk ``chunk``."""
    key = kv.keys(TOKENS)[chunk]
    if lower(place) == "nvme":
        path = next(Path(place["nvme_path"]).rglob(f"{key.hex}-*.kvc"))
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + offset] ^= 0x40
        path.write_bytes(bytes(data))
        return
    body = chunk_names(b"kvlayer:", key).body  # the payload's first bytes
    client = redis.Redis.from_url(place["redis_url"])
    try:
        byte = client.getrange(body, offset, offset)[0]
        client.setrange(body, offset, bytes([byte ^ 0x40]))
    finally:
        client.close()


@pytest.mark.parametrize("place", TIERS, indirect=True)
@pytest.mark.parametrize("offset", [1, 2 * LAYOUT.num_kv_heads * 4 + 3], ids=["scale", "code"])
def test_a_corrupted_quantized_chunk_is_a_counted_miss(place: dict[str, Any], offset: int) -> None:
    src, slots, dst = caches(), slots_for(32, 7), caches(fill=False)
    with engine(place, "fp8") as kv:
        store_and_flush(kv, src, slots)
        corrupt(place, kv, 1, offset)
        assert kv.retrieve(TOKENS, dst, slots) == 8, "the chunk before it is served, it and those after are not"
        stats = kv.stats()["tiers"][lower(place)]
        assert stats["backend"]["checksum_errors"] == 1 and stats["hit_tokens"] == 8
        assert_within_bound(kv_at(dst, slots[:8]), kv_at(src, slots[:8]), "fp8")
        assert kv.flush(timeout=60)
        assert kv.lookup(TOKENS).num_tokens == 8, "the bad chunk was deleted"


def test_a_bad_value_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"storage_quantization must be one of \('none', 'int8', 'fp8'\), got 'int4'"):
        KVLayerConfig(storage_quantization="int4")
    with pytest.raises(ConfigError, match="storage_quantization"):
        KVLayerConfig.load(env={"KVLAYER_STORAGE_QUANTIZATION": "fp16"})
    assert KVLayerConfig.load(env={"KVLAYER_STORAGE_QUANTIZATION": "fp8"}).storage_quantization == "fp8"
    assert KVLayerConfig().storage_quantization == "none", "lossy storage is never the default"
