"""The engine calls the connector interface at the right points, and really uses loaded KV."""

from __future__ import annotations

import torch

from kvlayer.connectors.base import ConnectorMetadata, KVConnectorBase, SchedulerOutput
from kvlayer.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(20, 100))  # 80 tokens


class Recording(KVConnectorBase):
    """Records every call; supplies nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        self.calls.append(("meta", tuple(s.request_id for s in scheduler_output.scheduled)))
        return ConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        return False

    def register_kv_caches(self, kv_caches):
        self.calls.append(("register", len(kv_caches)))

    def start_load_kv(self, metadata):
        self.calls.append(("start_load",))

    def wait_for_layer_load(self, layer):
        self.calls.append(("wait_layer", layer))

    def save_kv_layer(self, layer, kv_cache):
        self.calls.append(("save_layer", layer))

    def wait_for_save(self):
        self.calls.append(("wait_save",))


def test_call_order(tiny_model_dir):
    rec = Recording()
    llm = LLM(tiny_model_dir, num_gpu_blocks=64, kv_connector=rec)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    names = [c[0] for c in rec.calls]
    assert rec.calls[0] == ("register", 2)
    assert rec.calls[1] == ("match", "0", 0)
    assert rec.calls[2] == ("alloc", "0", 0)
    step = ["meta", "start_load", "wait_layer", "save_layer", "wait_layer", "save_layer", "wait_save"]
    assert names[3:10] == step
    assert names[10:17] == step  # the decode step
    assert names[17:] == ["finished"]


class Supplier(Recording):
    """Captures a request's prompt KV in one engine and supplies it to another."""

    def __init__(self, supply: dict | None = None, corrupt: bool = False) -> None:
        super().__init__()
        self.store: dict[int, torch.Tensor] = {} if supply is None else supply
        self.supplying = supply is not None
        self.corrupt = corrupt
        self.sched: SchedulerOutput | None = None
        self.pending: list[tuple[list[int], int, int]] = []
        self.first_computed: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 48 - num_computed_tokens if self.supplying else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.pending.append((list(block_ids), 48 - num_external_tokens, 48))

    def build_connector_meta(self, scheduler_output):
        self.sched = scheduler_output
        for s in scheduler_output.scheduled:
            self.first_computed.setdefault(s.request_id, s.num_computed_tokens)
        return ConnectorMetadata()

    def register_kv_caches(self, kv_caches):
        self.caches = kv_caches

    def start_load_kv(self, metadata):
        for blocks, start, end in self.pending:
            for layer, cache in enumerate(self.caches):
                kv = self.store[layer]
                if self.corrupt:
                    kv = torch.randn_like(kv)
                for p in range(start, end):
                    cache[:, blocks[p // 16], p % 16] = kv[:, p]
        self.pending = []

    def save_kv_layer(self, layer, kv_cache):
        if self.supplying:
            return
        for s in self.sched.scheduled:
            kv = self.store.setdefault(layer, torch.zeros((2, 200) + kv_cache.shape[3:]))
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                kv[:, p] = kv_cache[:, s.block_ids[p // 16], p % 16]


def test_supplied_tokens_are_skipped_and_read(tiny_model_dir):
    capture = Supplier()
    ref = LLM(tiny_model_dir, num_gpu_blocks=64, kv_connector=capture)
    expected = ref.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]

    good = Supplier(supply=capture.store)
    llm = LLM(tiny_model_dir, num_gpu_blocks=64, enable_prefix_caching=False, kv_connector=good)
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    assert out.num_external_tokens == 48
    assert good.first_computed[out.request_id] == 48, "the forward pass must skip supplied tokens"
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids

    bad = Supplier(supply=capture.store, corrupt=True)
    llm = LLM(tiny_model_dir, num_gpu_blocks=64, enable_prefix_caching=False, kv_connector=bad)
    wrong = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    assert wrong.outputs[0].token_ids != expected.outputs[0].token_ids, "supplied KV must really be read"
