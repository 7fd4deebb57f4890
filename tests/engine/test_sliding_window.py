"""Sliding-window and hybrid attention through the whole engine, against transformers.

Three tiny models with a window of 24 tokens, shorter than every prompt here (60-100 tokens):
a Mistral (every layer slides), a Qwen2 with ``max_window_layers=1`` (layer 0 full, layer 1
slides) and a Qwen2 hybrid written through ``layer_types`` (layer 0 slides, layer 1 full).
Every logits row the engine samples from equals transformers' at that position (relative error
1e-4) and the greedy tokens equal ``generate``'s, with prefix-cache hits, chunked prefill and
decodes far past the window. On the Mistral the engine also releases blocks that fell out of
the window, so a long decode holds a bounded number of blocks. Run:
``.venv/bin/python -m pytest tests/engine/test_sliding_window.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvlayer.engine import LLM, SamplingParams, attention
from kvlayer.engine.attention_metadata import AttentionMetadata, PrefillSpan
from kvlayer.engine.block_manager import FREED_BLOCK
from kvlayer.engine.outputs import RequestOutput
from kvlayer.engine.presets import init_model

transformers = pytest.importorskip("transformers")

WINDOW = 24
TOLERANCE = 1e-4
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
Rows = dict[str, dict[int, torch.Tensor]]


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {
        "mistral": init_model("tiny", root / "mistral", seed=5, architecture="mistral", sliding_window=WINDOW),
        "qwen2": init_model("tiny", root / "qwen2", seed=6, architecture="qwen2", sliding_window=WINDOW,
                            max_window_layers=1),
        "hybrid": init_model("tiny", root / "hybrid", seed=7, architecture="qwen2", sliding_window=WINDOW,
                             layer_types=("sliding_attention", "full_attention")),
    }


@pytest.fixture(scope="module")
def hf_model() -> Callable[[Path], torch.nn.Module]:
    models: dict[Path, torch.nn.Module] = {}

    def get(folder: Path) -> torch.nn.Module:
        if folder not in models:
            auto = transformers.AutoModelForCausalLM
            models[folder] = auto.from_pretrained(folder, dtype=torch.float32).eval()
        return models[folder]

    return get


def ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[RequestOutput], Rows]:
    """``llm.generate`` (greedy), recording each sampled logits row by request id and position."""
    runner = llm.engine.runner
    execute = runner.execute
    rows: Rows = {}

    def recording(plan, hooks=None):
        logits = execute(plan, hooks)
        for item, row in zip([s for s in plan.all if s.samples], logits, strict=True):
            position = item.seq.num_computed_tokens + item.num_new - 1
            rows.setdefault(item.seq.request_id, {})[position] = row
        return logits

    runner.execute = recording
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        del runner.execute
    return outs, rows


def check_against_transformers(hf: torch.nn.Module, outs: list[RequestOutput], rows: Rows) -> None:
    """Tokens equal ``generate``'s; every recorded row equals transformers' logits there."""
    for out in outs:
        prompt, tokens = list(out.prompt_token_ids), out.outputs[0].token_ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), min_new_tokens=len(tokens),
                              do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              pad_token_id=0)
            logits = hf(ref[:, :-1]).logits[0].float()
        assert tokens == tuple(ref[0, len(prompt):].tolist())
        recorded = rows[out.request_id]
        assert sorted(recorded) == list(range(len(prompt) - 1, len(prompt) + len(tokens) - 1))
        for position, row in recorded.items():
            error = ((row - logits[position]).abs().max() / logits[position].abs().max()).item()
            assert error <= TOLERANCE, f"{out.request_id}@{position}: relative error {error:.2e}"


@pytest.mark.parametrize("name", ["mistral", "qwen2", "hybrid"])
def test_prefix_hits_and_decodes_past_the_window(windowed_dirs, hf_model, name: str) -> None:
    folder = windowed_dirs[name]
    first = ids(70, seed=1)
    llm = LLM(folder, num_gpu_blocks=64)
    outs, rows = generate(llm, [first], max_tokens=40)
    # a hit of 64 tokens (of blocks the Mistral released while decoding), one of 48, and a miss
    again, branch, fresh = first, first[:48] + ids(40, seed=2), ids(90, seed=3)
    more, more_rows = generate(llm, [again, branch, fresh], max_tokens=40)
    assert [o.num_cached_tokens for o in more] == [64, 48, 0]
    check_against_transformers(hf_model(folder), outs + more, rows | more_rows)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "hybrid"])
def test_chunked_prefill_matches_transformers(windowed_dirs, hf_model, name: str) -> None:
    folder = windowed_dirs[name]
    llm = LLM(folder, num_gpu_blocks=64, max_num_batched_tokens=20)  # spans of 20 tokens at offsets
    outs, rows = generate(llm, [ids(60, seed=4), ids(100, seed=5)], max_tokens=30)
    check_against_transformers(hf_model(folder), outs, rows)


@pytest.mark.parametrize(("name", "bounded"), [("mistral", True), ("qwen2", False)])
def test_long_decode_holds_blocks_of_the_window_only(windowed_dirs, hf_model, name: str, bounded: bool) -> None:
    """Only a model whose every layer slides releases blocks (a full layer needs them all)."""
    folder = windowed_dirs[name]
    llm = LLM(folder, num_gpu_blocks=64)
    manager, step = llm.engine.block_manager, llm.engine.step
    used: list[int] = []

    def counting():
        outputs = step()
        used.append(manager.num_used_blocks)
        return outputs

    llm.engine.step = counting
    outs, rows = generate(llm, [ids(40, seed=6)], max_tokens=200)
    held = max(used[:-1])  # the last step finished the request
    # the window's 24 keys and the step's new token span at most 3 blocks of 16
    assert held == (3 if bounded else math.ceil(239 / 16))
    assert used[-1] == 0
    check_against_transformers(hf_model(folder), outs, rows)


def test_kvlayer_connector_with_released_blocks(windowed_dirs) -> None:
    """Chunks saved in the step that completes them load back exactly, at an offset past the
    window; a chunk due after a block of it was released is skipped, never read through."""
    folder = windowed_dirs["mistral"]
    prompt = ids(100, seed=7)
    baseline = LLM(folder, num_gpu_blocks=64).generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    kv = {"chunk_size": 48, "cpu_capacity": "4MiB"}
    with LLM(folder, num_gpu_blocks=64, enable_prefix_caching=False, kv_config=kv) as llm:
        llm.generate([{"prompt_token_ids": prompt}], GREEDY)  # one step: both chunks saved
        hit = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
        assert (hit.num_external_tokens, llm.engine.connector.num_skipped_saves) == (96, 0)
        assert hit.outputs[0].token_ids == baseline.outputs[0].token_ids
    with LLM(folder, num_gpu_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=20,
             kv_config=kv) as llm:
        chunked = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
        # chunk [0, 48) is due in the step over [40, 60), after block 0 was released (at 40 the
        # window reaches back to 17); [48, 96) in the step over [80, 100), which holds blocks 3-5
        assert llm.engine.connector.num_skipped_saves == 1
        # the window-aware tiers serve the 96-token prefix from its last chunk alone
        # (tests/connectors/test_window_tiers.py covers them)
        again = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
        assert again.num_external_tokens == 96
    assert chunked.outputs[0].token_ids == baseline.outputs[0].token_ids == again.outputs[0].token_ids


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int) -> torch.Tensor:
    """GQA attention of ``q`` [n, H, D] at positions first.. over ``k``/``v`` [ctx, KVH, D], each
    query at p seeing keys j with p - window < j <= p."""
    n, heads, dim = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k.double()) / math.sqrt(dim)
    p, j = torch.arange(n)[:, None] + first, torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(~((j <= p) & (j > p - window)), float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v.double()).float()


def poisoned_cache(kv_heads: int, dim: int, table: torch.Tensor, ctx: int, window: int, first: int,
                   num_blocks: int = 64, block_size: int = 16):
    """A random cache whose blocks wholly before position ``first - window + 1`` are NaN and
    marked ``FREED_BLOCK`` in the returned table, as released blocks are."""
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    flat = cache.view(2, -1, kv_heads, dim)
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
    keys, values = flat[0, slots].clone(), flat[1, slots].clone()
    released = max(0, first - window + 1) // block_size
    cache[:, table[:released]] = float("nan")
    marked = table.clone()
    marked[:released] = FREED_BLOCK
    return cache, marked, slots, keys, values


@pytest.mark.parametrize(("heads", "kv_heads", "n", "cached", "window"), [
    (4, 2, 30, 0, 7),      # fresh prefill longer than the window, folded query groups
    (4, 2, 200, 0, 24),    # ... too many rows to fold
    (4, 2, 5, 70, 24),     # a span over a cached prefix the window cuts
    (8, 8, 40, 50, 17),    # no GQA, cached prefix and own keys both cut
    (4, 1, 1, 63, 1),      # a window of one: only itself
])
def test_windowed_prefill_matches_plain_attention(heads, kv_heads, n, cached, window) -> None:
    torch.manual_seed(n * 7 + cached)
    dim, block_size, ctx = 16, 16, cached + n
    table = torch.randperm(64)[: -(-ctx // block_size)]
    cache, marked, slots, keys, values = poisoned_cache(kv_heads, dim, table, ctx, window, cached)
    q = torch.randn(n, heads, dim)
    meta = AttentionMetadata(slots[cached:], 0, torch.zeros((0, 1), dtype=torch.long),
                             torch.zeros((0,), dtype=torch.long), (PrefillSpan(0, n, ctx, marked),), block_size)
    out = attention.paged_attention(q, keys[cached:], values[cached:], cache, meta, 1 / math.sqrt(dim), window)
    torch.testing.assert_close(out, reference(q, keys, values, cached, window), atol=1e-5, rtol=1e-4)


def test_windowed_decode_matches_plain_attention() -> None:
    torch.manual_seed(3)
    heads, kv_heads, dim, block_size, window = 4, 2, 16, 16, 20
    lens = [1, 20, 21, 37, 100]
    tables, want, queries = [], [], torch.randn(len(lens), heads, dim)
    cache = torch.randn(2, 64, block_size, kv_heads, dim)
    free = torch.randperm(64).tolist()
    for i, length in enumerate(lens):  # one shared cache: each sequence's released blocks poisoned
        table = torch.tensor([free.pop() for _ in range(-(-length // block_size))])
        _, marked, slots, keys, values = poisoned_cache(kv_heads, dim, table, length, window, length - 1)
        flat = cache.view(2, -1, kv_heads, dim)
        flat[0, slots], flat[1, slots] = keys, values
        cache[:, table[marked < 0]] = float("nan")
        tables.append(marked)
        want.append(reference(queries[i : i + 1], keys, values, length - 1, window))
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t[-1:].expand(width - len(t))]) for t in tables])
    meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), padded,
                             torch.tensor(lens), (), block_size)
    out = attention.paged_attention(queries, queries, queries, cache, meta, 1 / math.sqrt(dim), window)
    torch.testing.assert_close(out, torch.cat(want), atol=1e-5, rtol=1e-4)
