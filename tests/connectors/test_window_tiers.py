"""Window-aware tiers under the bundled engine (kvlayer/windows.py, docs/heterogeneous.md).

Two tiny models with a 24-token window, prompts of 150 tokens in 16-token chunks: a Mistral
(every layer slides) and a Qwen2 hybrid (``layer_types``: layer 0 slides, layer 1 is full).
A hit on the 144-token prefix loads the window layers' KV only for the two chunks a query at
144 can read (32 tokens), and the full layer's for all 144. Greedy tokens equal transformers'
with hits from each tier; the bytes read are those of the chunk objects loaded; a window-only
prefix is served from its last chunks alone; a hybrid keeps one object per window group; the
engine's prefix cache never offers a block whose window KV was not loaded; a corrupt window
chunk is a recompute.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlayer import serde
from kvlayer.engine import LLM, SamplingParams
from kvlayer.engine.outputs import RequestOutput
from kvlayer.engine.presets import init_model
from kvlayer.keys import group_key
from tests.redis_server import RedisServer, require_binary

transformers = pytest.importorskip("transformers")

WINDOW, CHUNK, PROMPT = 24, 16, 150
HELD = PROMPT // CHUNK * CHUNK  # 144: the stored prefix (nine full chunks)
LAYER_CHUNK_BYTES = CHUNK * 2 * 2 * 16 * 4  # one layer of a chunk of the tiny preset: K and V, 2 heads x 16, float32
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


PROMPT_IDS = ids(PROMPT, seed=11)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("window-tiers")
    return {
        "mistral": init_model("tiny", root / "mistral", seed=21, architecture="mistral", sliding_window=WINDOW),
        "hybrid": init_model("tiny", root / "hybrid", seed=22, architecture="qwen2", sliding_window=WINDOW,
                             layer_types=("sliding_attention", "full_attention")),
    }


@pytest.fixture(scope="module")
def hf_greedy(models: dict[str, Path]) -> Any:
    """transformers' greedy continuation of a prompt on one of ``models`` (cached)."""
    done: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}

    def get(name: str, prompt: Sequence[int]) -> tuple[int, ...]:
        if (name, tuple(prompt)) not in done:
            hf = transformers.AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
            with torch.inference_mode():
                out = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=GREEDY.max_tokens,
                                  min_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            done[name, tuple(prompt)] = tuple(out[0, len(prompt):].tolist())
        return done[name, tuple(prompt)]

    return get


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    require_binary("redis-server")
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()


def engine(folder: Path, kv: dict[str, Any], prefix_caching: bool = False) -> LLM:
    return LLM(folder, num_gpu_blocks=64, enable_prefix_caching=prefix_caching, kv_config={"chunk_size": CHUNK, **kv})


def ask(llm: LLM, prompt: Sequence[int]) -> RequestOutput:
    return llm.generate([{"prompt_token_ids": list(prompt)}], GREEDY)[0]


def stats(llm: LLM) -> dict[str, Any]:
    return llm.kv_stats()


def tier_settings(tier: str, tmp_path: Path, redis_url: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(settings of the instance that stores, settings of the one that hits from ``tier`` only)."""
    if tier == "cpu":
        return {"cpu_capacity": "8MiB"}, {}
    if tier == "nvme":
        lower = {"nvme_path": str(tmp_path / "kv"), "nvme_capacity": "64MiB"}
    else:
        lower = {"redis_url": redis_url, "redis_key_prefix": f"win-{tmp_path.name}"}
    return {"cpu_capacity": "8MiB", **lower}, {"cpu_capacity": 0, **lower}


@pytest.mark.parametrize("tier", ["cpu", "nvme", pytest.param("redis", marks=pytest.mark.redis)])
@pytest.mark.parametrize("name", ["mistral", "hybrid"])
def test_hits_load_the_window_only_and_equal_transformers(models, hf_greedy, tier: str, name: str, tmp_path,
                                                          request) -> None:
    url = request.getfixturevalue("redis_url") if tier == "redis" else None
    store, hit = tier_settings(tier, tmp_path, url)
    with engine(models[name], store) as llm:
        first = ask(llm, PROMPT_IDS)
        assert llm.engine.connector.flush_writes(30)
        if tier == "cpu":
            again = ask(llm, PROMPT_IDS)
            loaded, got = stats(llm)["loaded_tokens"], 0
    if tier != "cpu":
        with engine(models[name], hit) as llm:
            again = ask(llm, PROMPT_IDS)
            loaded, got = stats(llm)["loaded_tokens"], stats(llm)["tiers"][tier]["get_bytes"]
    want = hf_greedy(name, PROMPT_IDS)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    assert again.num_external_tokens == HELD
    # a query at 144 reads back to 121: chunks [112, 128) and [128, 144) of the window layers
    window_objects, full_objects = 2, (HELD // CHUNK if name == "hybrid" else 0)
    assert loaded == ({"window:24": 32, "full": HELD} if name == "hybrid" else {"window:24": 32})
    layers_per_window_object = 1 if name == "hybrid" else 2
    if tier != "cpu":
        assert got == (window_objects * layers_per_window_object + full_objects) * LAYER_CHUNK_BYTES


def test_a_window_only_prefix_is_served_from_its_last_chunks(models, hf_greedy) -> None:
    with engine(models["mistral"], {"cpu_capacity": "8MiB"}) as llm:
        ask(llm, PROMPT_IDS)
        kv = llm.engine.connector.kv
        keys = kv.keys(PROMPT_IDS)
        assert kv.remove(keys[:7]) == 7  # only [112, 144) is left
        again = ask(llm, PROMPT_IDS)
        assert again.num_external_tokens == HELD
        assert again.outputs[0].token_ids == hf_greedy("mistral", PROMPT_IDS)
        kv.remove(kv.keys(PROMPT_IDS)[7:8])  # a chunk the window needs: no shorter prefix has its window
        assert ask(llm, PROMPT_IDS).num_external_tokens == 0


def test_a_hybrid_keeps_one_object_per_window_group(models, hf_greedy, tmp_path) -> None:
    nvme = {"cpu_capacity": 0, "nvme_path": str(tmp_path), "nvme_capacity": "64MiB"}
    with engine(models["hybrid"], nvme) as llm:
        ask(llm, PROMPT_IDS)
        llm.engine.connector.flush_writes(30)
        kv = llm.engine.connector.kv
        files = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= LAYER_CHUNK_BYTES]
        assert len(files) == 2 * (HELD // CHUNK)
        shapes = {serde.decode_header(p.read_bytes()[: serde.HEADER_SIZE]).shape for p in files}
        assert shapes == {(1, 2, CHUNK, 2, 16)}  # one layer each
        full, window = kv.layout.window_groups
        assert (full.window, full.layers, window.window, window.layers) == (None, (1,), WINDOW, (0,))
        keys = kv.keys(PROMPT_IDS)
        assert kv.remove([group_key(k, window, 2) for k in keys[:7]]) == 7  # window KV no query reads
        assert ask(llm, PROMPT_IDS).num_external_tokens == HELD
        assert kv.remove([group_key(keys[5], full, 2)]) == 1  # the full layer's chunk [80, 96)
        # the prefix ends at 80, whose window ([57, 80): chunks 3 and 4) was removed: nothing
        # is left to load; the window-aware lookup never serves a prefix whose window is missing
        assert ask(llm, PROMPT_IDS).num_external_tokens == 0
        second = ids(100, seed=12)
        ask(llm, second)
        llm.engine.connector.flush_writes(30)  # NVMe writes run in the background
        hit = ask(llm, second)
        assert hit.num_external_tokens == 96 and hit.outputs[0].token_ids == hf_greedy("hybrid", second)


@pytest.mark.parametrize("name", ["mistral", "hybrid"])
def test_partly_loaded_blocks_never_serve_the_engine_prefix_cache(models, hf_greedy, name: str) -> None:
    """Blocks of [0, 112) got the full layer's KV only (or none): a request sharing 100 of
    those tokens must compute them, not read window KV that was never loaded."""
    branch = PROMPT_IDS[:100] + ids(30, seed=13)
    with engine(models[name], {"cpu_capacity": "8MiB"}, prefix_caching=True) as llm:
        ask(llm, PROMPT_IDS)
        llm.reset_prefix_cache()
        loaded = ask(llm, PROMPT_IDS)
        assert (loaded.num_cached_tokens, loaded.num_external_tokens) == (0, HELD)
        other = ask(llm, branch)
        assert other.num_cached_tokens == 0  # the engine offered none of the partly loaded blocks
        assert other.num_external_tokens == 96  # kvlayer's window-aware hit instead
        assert other.outputs[0].token_ids == hf_greedy(name, branch)
        assert loaded.outputs[0].token_ids == hf_greedy(name, PROMPT_IDS)
        repeat = ask(llm, PROMPT_IDS)  # blocks of [112, 150) are whole, but a hit starts at 0
        assert repeat.outputs[0].token_ids == hf_greedy(name, PROMPT_IDS)


def test_a_corrupt_window_chunk_is_a_recompute(models, hf_greedy, tmp_path) -> None:
    nvme = {"cpu_capacity": 0, "nvme_path": str(tmp_path), "nvme_capacity": "64MiB"}
    with engine(models["mistral"], nvme) as llm:
        ask(llm, PROMPT_IDS)
        llm.engine.connector.flush_writes(30)
        last = llm.engine.connector.kv.keys(PROMPT_IDS)[8]
    path = next(p for p in tmp_path.rglob("*") if p.is_file() and last.hex in p.name)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with engine(models["mistral"], nvme) as llm:
        out = ask(llm, PROMPT_IDS)
        assert out.outputs[0].token_ids == hf_greedy("mistral", PROMPT_IDS)
        assert stats(llm)["tiers"]["nvme"]["checksum_errors"] == 1
        assert "window:24" not in stats(llm)["loaded_tokens"]  # the load failed as a whole


def test_window_aware_off_loads_every_layer_for_every_token(models, hf_greedy) -> None:
    with engine(models["hybrid"], {"cpu_capacity": "8MiB", "window_aware": False}) as llm:
        ask(llm, PROMPT_IDS)
        again = ask(llm, PROMPT_IDS)
        assert again.num_external_tokens == HELD and stats(llm)["loaded_tokens"] == {"full": HELD}
        assert again.outputs[0].token_ids == hf_greedy("hybrid", PROMPT_IDS)
