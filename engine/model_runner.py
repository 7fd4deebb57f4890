"""Runs one scheduled step through the model: inputs, attention metadata, forward, logits.

Owns the paged KV cache: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
per layer on the engine's device. A decode's block table is padded with its own last block, so
the masked columns of one request's attention never read another request's KV (a NaN there
would pass the mask: NaN + -inf is NaN).
"""

from __future__ import annotations

import torch

from kvlayer.engine.attention_metadata import AttentionMetadata, LayerHooks, NoHooks, PrefillSpan
from kvlayer.engine.model import CausalLM
from kvlayer.engine.model_config import ModelConfig
from kvlayer.engine.scheduler import StepPlan


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    """Executes steps of ``model``; the KV caches are allocated here once."""

    def __init__(self, model: CausalLM, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero the KV of ``block_ids`` in every layer (a failed request's NaN or infinity)."""
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            for cache in self.kv_caches:
                cache.index_fill_(1, index, 0)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat ``input_ids``, ``positions`` and the attention metadata of ``plan``."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for item in plan.all:
            seq, start = item.seq, item.seq.num_computed_tokens
            table = seq.block_table
            for p in range(start, start + item.num_new):
                slots.append(table[p // bs] * bs + p % bs)
            ids.extend(seq.token_ids[start : start + item.num_new])
            pos.extend(range(start, start + item.num_new))
        dev = self.device
        decodes = plan.decodes
        if decodes:
            width = max(len(d.seq.block_table) for d in decodes)
            tables = torch.tensor([_padded(d.seq.block_table, width) for d in decodes],
                                  dtype=torch.long, device=dev)
            lens = torch.tensor([d.seq.num_computed_tokens + 1 for d in decodes], dtype=torch.long, device=dev)
        else:
            tables = torch.zeros((0, 1), dtype=torch.long, device=dev)
            lens = torch.zeros((0,), dtype=torch.long, device=dev)
        spans = []
        offset = len(decodes)
        for item in plan.prefills:
            ctx = item.seq.num_computed_tokens + item.num_new
            table = torch.tensor(item.seq.block_table[: -(-ctx // bs)], dtype=torch.long, device=dev)
            spans.append(PrefillSpan(offset, offset + item.num_new, ctx, table))
            offset += item.num_new
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decodes), decode_block_tables=tables, decode_context_lens=lens,
            prefills=tuple(spans), block_size=bs,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, hooks: LayerHooks | None = None) -> torch.Tensor:
        """Run the step; returns float32 logits ``[num_sampling, vocab]`` for the items that sample,
        in ``plan.all`` order."""
        input_ids, positions, meta = self.prepare(plan)
        hidden = self.model(input_ids, positions, meta, self.kv_caches, hooks or NoHooks())
        last, offset = [], 0
        for item in plan.all:
            offset += item.num_new
            if item.samples:
                last.append(offset - 1)
        if not last:
            return torch.empty((0, self.cfg.vocab_size), dtype=torch.float32)
        index = torch.tensor(last, dtype=torch.long, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index))


def _padded(table: list[int], width: int) -> list[int]:
    """``table`` to ``width`` entries, repeating its last block (masked: only ever its own KV)."""
    return table + [table[-1]] * (width - len(table))
