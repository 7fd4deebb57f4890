"""``KVCacheEngine``: the engine-agnostic API, on random paged caches (no model involved)."""

from __future__ import annotations

import random

import pytest
import torch

from kvlayer import ConfigError, KVCacheEngine, KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
NUM_BLOCKS = 64


def caches(fill: bool = True) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape) if fill else torch.zeros(shape) for _ in range(LAYOUT.num_layers)]


def slots_for(n: int, seed: int) -> torch.Tensor:
    """A random (non-contiguous) block table's slots for n tokens."""
    blocks = random.Random(seed).sample(range(NUM_BLOCKS), -(-n // LAYOUT.block_size))
    return torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(n)])


def kv_at(cs: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.view(2, -1, 2, 8)[:, slots] for c in cs])


@pytest.fixture
def kv():
    with KVCacheEngine({"chunk_size": 8, "cpu_capacity": "1MiB"}, LAYOUT, model_name="m",
                       model_fingerprint="f") as eng:
        yield eng


def test_store_then_retrieve_into_other_slots(kv):
    tokens = list(range(100, 130))  # 3 full chunks of 8 + 6 tokens
    src, src_slots = caches(), slots_for(30, 1)
    assert kv.lookup(tokens).num_tokens == 0
    assert kv.store(tokens, src, src_slots) == 3
    assert kv.lookup(tokens).num_tokens == 24
    assert kv.store(tokens, src, src_slots) == 0  # already held
    dst, dst_slots = caches(fill=False), slots_for(30, 2)
    assert kv.retrieve(tokens, dst, dst_slots) == 24
    assert torch.equal(kv_at(dst, dst_slots[:24]), kv_at(src, src_slots[:24]))
    assert not kv_at(dst, dst_slots[24:]).any()


def test_retrieve_from_start_leaves_earlier_slots_alone(kv):
    tokens = list(range(7, 39))
    src, slots = caches(), slots_for(32, 3)
    kv.store(tokens, src, slots)
    dst = caches(fill=False)
    assert kv.retrieve(tokens, dst, slots, start=10) == 32
    assert not kv_at(dst, slots[:10]).any()
    assert torch.equal(kv_at(dst, slots[10:]), kv_at(src, slots[10:]))


def test_prefix_and_salt(kv):
    tokens = list(range(50, 82))
    kv.store(tokens, caches(), slots_for(32, 4))
    assert kv.lookup(tokens[:20] + [1] * 12).num_tokens == 16
    assert kv.lookup(tokens, cache_salt="other").num_tokens == 0
    assert kv.lookup([1] + tokens[1:]).num_tokens == 0  # the chain: a change early misses everything


def test_a_tracked_requests_keys_follow_its_salt(kv):
    tokens = list(range(50, 82))
    kv.store(tokens, caches(), slots_for(32, 4))
    assert kv.lookup(tokens, request_id="r").num_tokens == 32
    assert kv.lookup(tokens, "reset", request_id="r").num_tokens == 0, "its kept keys were the old salt's"
    assert kv.lookup(tokens, request_id="r").num_tokens == 32


def test_dropping_private_memory_empties_the_cpu_tier_but_not_nvme(tmp_path):
    with KVCacheEngine({"chunk_size": 8, "cpu_capacity": "1MiB", "nvme_path": str(tmp_path)}, LAYOUT,
                       model_name="m", model_fingerprint="f") as eng:
        tokens = list(range(50, 82))
        assert eng.store(tokens, caches(), slots_for(32, 4)) == 4
        eng.tiers.flush(10)
        files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
        assert eng.drop_private_memory() == 4
        assert eng.stats()["tiers"]["cpu"]["used_bytes"] == 0 and eng.snapshot()["cpu"] == []
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files, "NVMe keeps its files"
        found = eng.lookup(tokens)
        assert found.num_tokens == 32 and set(found.sources) == {eng.tier_names.index("nvme")}


def test_partial_chunks_when_configured():
    with KVCacheEngine({"chunk_size": 8, "save_partial_chunks": True}, LAYOUT) as eng:
        tokens = list(range(20))
        src, slots = caches(), slots_for(20, 5)
        assert eng.store(tokens, src, slots) == 3
        assert eng.lookup(tokens).num_tokens == 20
        dst = caches(fill=False)
        assert eng.retrieve(tokens, dst, slots) == 20
        assert torch.equal(kv_at(dst, slots), kv_at(src, slots))


def test_bad_slot_mapping_is_an_error(kv):
    with pytest.raises(ValueError, match="slot_mapping"):
        kv.store(list(range(16)), caches(), slots_for(8, 6))


def test_stats_and_close_are_idempotent():
    eng = KVCacheEngine({"chunk_size": 8}, LAYOUT)
    eng.store(list(range(8)), caches(), slots_for(8, 7))
    eng.retrieve(list(range(8)), caches(fill=False), slots_for(8, 8))
    s = eng.stats()["tiers"]["cpu"]
    assert s["put_chunks"] == 1 and s["hit_tokens"] == 8
    eng.close()
    eng.close()
    assert eng.staging.used_count == 0


def test_metrics_port_serves_prometheus_text(tmp_path):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"chunk_size": 8, "cpu_capacity": "1MiB", "metrics_port": port, "instance_id": "exp-a"}
    with KVCacheEngine(cfg, LAYOUT, model_name="m") as eng, \
            KVCacheEngine({**cfg, "instance_id": "exp-b"}, LAYOUT, model_name="m"):
        tokens = list(range(16))
        eng.store(tokens, caches(), slots_for(16, 9))
        eng.retrieve(tokens, caches(fill=False), slots_for(16, 10))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvlayer_hit_tokens_total{instance="exp-a",tier="cpu"} 16.0' in text
    assert 'instance="exp-b"' in text, "two instances share one port"
    with pytest.raises(ConfigError, match="metrics_port"):
        KVCacheEngine({"metrics_port": 70000}, LAYOUT)



def test_a_device_this_machine_lacks_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        KVCacheEngine({"chunk_size": 8, "cpu_capacity": "1MiB"}, LAYOUT, device="cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        KVCacheEngine({"chunk_size": 8}, LAYOUT, device="gpu")


def test_each_tensor_parallel_rank_has_an_instance_id_of_its_own() -> None:
    ids = []
    for rank, size in ((0, 1), (1, 2)):
        kv = KVCacheEngine({"instance_id": "node-a", "cpu_capacity": "1MiB"}, LAYOUT, tp_rank=rank, tp_size=size)
        ids.append((kv.instance_id, kv.namespace.tp_rank))
        kv.close()
    assert ids == [("node-a", 0), ("node-a-tp1", 1)]
