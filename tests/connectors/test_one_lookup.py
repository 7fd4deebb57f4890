"""The one lookup (docs/architecture.md section 13): on a hybrid sliding-window layout,
``KVCacheEngine.lookup`` reports exactly what ``retrieve`` loads, and what vLLM's worker side
answers its scheduler and then loads, on every tier."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.connectors.lookup_channel import Query
from kvlayer.connectors.vllm_worker import WorkerSide
from kvlayer.layout import KVLayout
from kvlayer.step import LoadSpec, SaveSpec, StepSpec

# the case: 4 layers, windows (None, 40, None, 40), 32-token chunks, a 400-token prompt
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=16,
                  layer_windows=(None, 40, None, 40))
CHUNK, PROMPT = 32, list(range(1000, 1400))
BLOCKS = 32


def caches(fill: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, BLOCKS, 16, 2, 8, generator=g) if fill else torch.zeros(2, BLOCKS, 16, 2, 8)
            for _ in range(LAYOUT.num_layers)]


@pytest.fixture(params=["cpu", "nvme", "redis"])
def tier(request, tmp_path) -> dict[str, Any]:
    if request.param == "cpu":
        return {"cpu_capacity": "64MiB"}
    if request.param == "nvme":
        return {"cpu_capacity": 0, "nvme_path": str(tmp_path / "nvme")}
    server = request.getfixturevalue("redis_server")
    return {"cpu_capacity": 0, "redis_url": server.url}


def written(dst: list[torch.Tensor], src: list[torch.Tensor], slots: torch.Tensor, layer: int) -> int:
    """How many leading tokens of ``slots`` hold ``src``'s KV in ``dst`` for ``layer``."""
    a = dst[layer].view(2, -1, 2, 8)[:, slots]
    b = src[layer].view(2, -1, 2, 8)[:, slots]
    same = (a == b).flatten(2).all(-1).all(0)
    return int(same.int().cumprod(0).sum())


def test_lookup_is_what_retrieve_loads_on_a_hybrid(tier: dict[str, Any]) -> None:
    config = {"chunk_size": CHUNK, **tier}
    src, slots = caches(), torch.arange(len(PROMPT))
    with KVCacheEngine(config, LAYOUT, model_name="hybrid") as kv:
        kv.store(PROMPT, src, slots)
        assert kv.flush(10)
        found = kv.lookup(PROMPT)
        assert found.num_tokens == 384, "12 full chunks of 32"
        assert 0 < found.all_layers_from < found.num_tokens, "the window layers' KV only near the end"
        dst = caches(fill=False)
        assert kv.retrieve(PROMPT, dst, slots) == found.num_tokens
        assert written(dst, src, slots, 0) == found.num_tokens, "a full layer: every token"
        assert written(dst, src, slots[found.all_layers_from:], 1) == found.num_tokens - found.all_layers_from
        limited = kv.lookup(PROMPT, start=64, limit=len(PROMPT) - 1)
        assert limited.num_tokens == 384 and len(limited.keys) == len(limited.sources)


def test_vllms_worker_answers_and_loads_the_same(tier: dict[str, Any], tmp_path) -> None:
    config = {"chunk_size": CHUNK, "layerwise": "off", **tier}
    from kvlayer.config import KVLayerConfig

    src, dst = caches(), caches(fill=False)
    blocks = tuple(range(BLOCKS))
    engine = {"model_name": "hybrid", "device": "cpu"}
    worker = WorkerSide(KVLayerConfig.load(config), LAYOUT, str(tmp_path / "lookup.sock"), engine)
    try:
        names = [f"layers.{i}.attn" for i in range(LAYOUT.num_layers)]
        worker.register(names, src)
        worker.bind(StepSpec(saves=(SaveSpec("a", None, tuple(PROMPT[:384]), blocks, 0),)))
        worker.finish()
        assert worker.kv.flush(10)
        direct = worker.kv.lookup(PROMPT, start=0, limit=399)
        found, sources = worker._answer(Query(PROMPT, None, "b", 0, 384))
        assert (found, sources) == (direct.num_tokens, direct.sources) and found == 384
        worker.register(names, dst)
        worker.bind(StepSpec(loads=(LoadSpec("b", None, tuple(PROMPT[:found]), blocks, 0, found, sources),)))
        worker.start_load()
        worker.finish()
        assert worker.load_errors() == set()
        assert worker.totals["loaded_tokens"] == 384
        slots = torch.arange(found)
        assert written(dst, src, slots, 0) == 384
        assert written(dst, src, slots[direct.all_layers_from:], 3) == 384 - direct.all_layers_from
    finally:
        worker.close()


@pytest.mark.parametrize("windows", [(), (None, 40, None, 40)], ids=["full", "hybrid"])
def test_chunks_the_request_holds_are_never_asked_for(windows, tmp_path) -> None:
    """A request that holds its first tokens (the engine's own prefix cache) loads the rest even
    when kvlayer lost those first chunks: a chained key names its whole prefix."""
    import dataclasses

    layout = dataclasses.replace(LAYOUT, layer_windows=windows)
    src, slots = caches(), torch.arange(len(PROMPT))
    with KVCacheEngine({"chunk_size": CHUNK, "cpu_capacity": "64MiB"}, layout, model_name="held") as kv:
        kv.store(PROMPT, src, slots)
        assert kv.flush(10)
        from kvlayer.windows import save_keys

        first = save_keys(layout, kv.keys(PROMPT)[:3])
        assert kv.remove(first) == len(first)
        assert kv.lookup(PROMPT).num_tokens == 0
        found = kv.lookup(PROMPT, start=96)
        assert found.num_tokens == 384 and len(found.keys) == len(found.sources)
        dst = caches(fill=False)
        assert kv.retrieve(PROMPT, dst, slots, start=96) == 384
        assert written(dst, src, slots[96:], 0) == 384 - 96
        assert not dst[0].view(2, -1, 2, 8)[:, slots[:96]].any(), "the held tokens are not written"
        assert kv.lookup(PROMPT, start=100).num_tokens == 384, "a start inside a chunk asks from that chunk"
