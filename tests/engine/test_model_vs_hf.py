"""Our CausalLM against transformers' own Llama/Qwen2/Mistral on the same random weights.

Every way of feeding a prompt through the paged cache (one shot, two spans over a cached prefix,
token-by-token decodes, several sequences mixed in one step) must give transformers' logits to
a relative error of 1e-4. Run: ``.venv/bin/python -m pytest tests/engine/test_model_vs_hf.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvlayer.engine.attention_metadata import AttentionMetadata, NoHooks, PrefillSpan
from kvlayer.engine.loader import load_model
from kvlayer.engine.model import CausalLM
from kvlayer.engine.model_config import RopeScaling
from kvlayer.engine.presets import init_model

transformers = pytest.importorskip("transformers")

BLOCK = 16
TOLERANCE = 1e-4
HfLogits = Callable[[Path, list[int]], torch.Tensor]


class Paged:
    """A model with its own paged KV cache, stepped with hand-built ``AttentionMetadata`` (no runner).

    Sequences get shuffled, hence non-contiguous, block ids.
    """

    def __init__(self, model: CausalLM, num_blocks: int = 128) -> None:
        cfg = model.config
        self.model = model
        self.caches = [
            torch.zeros(2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)
        ]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()

    def table(self, max_tokens: int) -> torch.Tensor:
        """A block table for a sequence of up to ``max_tokens`` tokens."""
        count = -(-max_tokens // BLOCK)
        blocks, self.free = self.free[:count], self.free[count:]
        return torch.tensor(blocks, dtype=torch.long)

    def step(
        self,
        decodes: list[tuple[int, int, torch.Tensor]] = (),
        prefills: list[tuple[list[int], int, torch.Tensor]] = (),
        hooks: object = None,
    ) -> torch.Tensor:
        """Run one step -> float32 logits ``[T, vocab]`` in flat-batch order.

        ``decodes``: ``(token, position, table)``; ``prefills``: ``(tokens, first_position, table)``.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []

        def add(token: int, position: int, table: torch.Tensor) -> None:
            ids.append(token)
            positions.append(position)
            slots.append(int(table[position // BLOCK]) * BLOCK + position % BLOCK)

        for token, position, table in decodes:
            add(token, position, table)
        spans = []
        for tokens, first, table in prefills:
            start = len(ids)
            for i, token in enumerate(tokens):
                add(token, first + i, table)
            spans.append(PrefillSpan(start, len(ids), first + len(tokens), table))
        width = max((len(table) for _, _, table in decodes), default=1)
        tables = [torch.cat([t, t[:1].expand(width - len(t))]) for _, _, t in decodes]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decodes=len(decodes),
            decode_block_tables=torch.stack(tables) if tables else torch.zeros((0, 1), dtype=torch.long),
            decode_context_lens=torch.tensor([p + 1 for _, p, _ in decodes], dtype=torch.long),
            prefills=tuple(spans),
            block_size=BLOCK,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            self.caches,
            hooks or NoHooks(),
        )
        return self.model.compute_logits(hidden)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    error = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert error <= TOLERANCE, f"relative error {error:.2e}"


def prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_logits() -> HfLogits:
    """``hf_logits(folder, tokens)``: transformers' float32 logits ``[len(tokens), vocab]``."""
    models: dict[Path, torch.nn.Module] = {}

    def run(folder: Path, tokens: list[int]) -> torch.Tensor:
        if folder not in models:
            auto = transformers.AutoModelForCausalLM
            models[folder] = auto.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[folder](torch.tensor([tokens])).logits[0].float()

    return run


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # wavelengths of the tiny head (6 .. 2e4 positions) straddle both thresholds (64, 256)
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
    )
    return init_model("tiny", tmp_path_factory.mktemp("m") / "llama3", seed=3, rope_scaling=scaling)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny", tmp_path_factory.mktemp("m") / "tied", seed=4, tie_word_embeddings=True)


ARCHITECTURES = ["tiny_model_dir", "qwen2_model_dir", "mistral_model_dir", "llama3_dir", "tied_llama_dir"]


@pytest.fixture(params=ARCHITECTURES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("length", [1, 7, 16, 33, 100])
def test_one_shot_prefill_matches_transformers(model_dir: Path, length: int, hf_logits: HfLogits) -> None:
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    tokens = prompt(length, cfg.vocab_size, seed=length)
    paged = Paged(model)
    assert_close(paged.step(prefills=[(tokens, 0, paged.table(length))]), hf_logits(model_dir, tokens))


@pytest.mark.parametrize(("length", "split"), [(33, 16), (100, 37), (40, 1)])
def test_two_spans_over_cached_prefix_match_one_shot(
    model_dir: Path, length: int, split: int, hf_logits: HfLogits
) -> None:
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    tokens = prompt(length, cfg.vocab_size, seed=11)
    paged = Paged(model)
    table = paged.table(length)
    first = paged.step(prefills=[(tokens[:split], 0, table)])
    rest = paged.step(prefills=[(tokens[split:], split, table)])
    ref = hf_logits(model_dir, tokens)
    assert_close(first, ref[:split])
    assert_close(rest, ref[split:])


def test_token_by_token_decode_matches_one_shot(model_dir: Path, hf_logits: HfLogits) -> None:
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    tokens = prompt(40, cfg.vocab_size, seed=5)
    paged = Paged(model)
    table = paged.table(len(tokens))
    steps = [paged.step(prefills=[(tokens[:3], 0, table)])[-1]]
    steps += [paged.step(decodes=[(tokens[p], p, table)])[0] for p in range(3, len(tokens))]
    assert_close(torch.stack(steps), hf_logits(model_dir, tokens)[2:])


def test_mixed_step_of_decodes_and_prefills(tiny_model_dir: Path, hf_logits: HfLogits) -> None:
    """Two decodes of different lengths, a fresh prefill and a prefill over a cached prefix, in one step."""
    model, cfg = load_model(tiny_model_dir, torch.float32, "cpu")
    paged = Paged(model)
    seqs = [prompt(n, cfg.vocab_size, seed=n) for n in (21, 50, 9, 45)]
    tables = [paged.table(len(s)) for s in seqs]
    paged.step(prefills=[(seqs[0][:-1], 0, tables[0]), (seqs[1][:-1], 0, tables[1])])
    paged.step(prefills=[(seqs[3][:17], 0, tables[3])])
    logits = paged.step(
        decodes=[(seqs[0][-1], len(seqs[0]) - 1, tables[0]), (seqs[1][-1], len(seqs[1]) - 1, tables[1])],
        prefills=[(seqs[2], 0, tables[2]), (seqs[3][17:], 17, tables[3])],
    )
    assert_close(logits[0], hf_logits(tiny_model_dir, seqs[0])[-1])
    assert_close(logits[1], hf_logits(tiny_model_dir, seqs[1])[-1])
    assert_close(logits[2:11], hf_logits(tiny_model_dir, seqs[2]))
    assert_close(logits[11:], hf_logits(tiny_model_dir, seqs[3])[17:])


class RecordingHooks:
    """Records hook calls, and whether each layer's new keys are in its cache when attention starts."""

    def __init__(self, caches: list[torch.Tensor], slots: torch.Tensor) -> None:
        self.caches = caches
        self.slots = slots
        self.calls: list[tuple[str, int]] = []
        self.written: list[bool] = []

    def before_attention(self, layer: int) -> None:
        self.calls.append(("before", layer))
        keys = self.caches[layer][0].flatten(0, 1)[self.slots]
        self.written.append(bool(keys.abs().sum(dim=(1, 2)).gt(0).all()))

    def after_attention(self, layer: int, kv_cache: torch.Tensor) -> None:
        assert kv_cache is self.caches[layer]
        self.calls.append(("after", layer))


def test_hooks_run_in_layer_order_after_kv_is_written(tiny_model_dir: Path) -> None:
    model, cfg = load_model(tiny_model_dir, torch.float32, "cpu")
    paged = Paged(model)
    table = paged.table(20)
    slots = torch.tensor([int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(20)])
    hooks = RecordingHooks(paged.caches, slots)
    paged.step(prefills=[(prompt(20, cfg.vocab_size), 0, table)], hooks=hooks)
    assert hooks.calls == [(kind, layer) for layer in range(cfg.num_layers) for kind in ("before", "after")]
    assert hooks.written == [True] * cfg.num_layers


def test_sharded_checkpoint_loads_identically(tmp_path: Path, hf_logits: HfLogits) -> None:
    single = init_model("tiny", tmp_path / "single", seed=9)
    sharded = init_model("tiny", tmp_path / "sharded", seed=9, shard_size=100_000)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a, _ = load_model(single, torch.float32, "cpu")
    b, _ = load_model(sharded, torch.float32, "cpu")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    tokens = prompt(30, 512)
    assert torch.equal(Paged(a).step(prefills=[(tokens, 0, torch.arange(2))]),
                       Paged(b).step(prefills=[(tokens, 0, torch.arange(2))]))
    assert_close(Paged(b).step(prefills=[(tokens, 0, torch.arange(2))]), hf_logits(sharded, tokens))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_near_float32(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    tokens = prompt(33, 512, seed=2)
    full, _ = load_model(tiny_model_dir, torch.float32, "cpu")
    half, _ = load_model(tiny_model_dir, dtype, "cpu")
    paged = Paged(half)
    paged.caches = [cache.to(dtype) for cache in paged.caches]
    ours = paged.step(prefills=[(tokens, 0, paged.table(33))])
    ref = Paged(full).step(prefills=[(tokens, 0, torch.arange(3))])
    assert ours.dtype == torch.float32
    # measured: bfloat16 ~2e-2, float16 ~3e-3
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 0.05
