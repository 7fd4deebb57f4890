"""The engine (``LLMEngine``: add_request/step) and its vLLM-shaped facade (``LLM.generate``).

``step()`` is the whole request path: schedule, load external KV, run the model (with the
connector's per-layer hooks), wait for saves, sample, finish.

Requests fail alone: a request whose sampling fails (its logits processor raises, its logits
are NaN or infinite, its draw raises) finishes with reason ``"error"`` and a one-line
``CompletionOutput.error``; the others in its step go on as if it had not been there. Bad
sampling values never get that far: ``SamplingParams`` refuses them (``InvalidSamplingParam``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

import torch

from kvlayer.connectors.base import KVConnectorBase, KVConnectorContext, ScheduledRequest, SchedulerOutput
from kvlayer.engine.block_manager import BlockManager
from kvlayer.engine.config import (
    DEFAULT_KV_CACHE_MEMORY,
    EngineConfig,
    parse_device,
    parse_engine_dtype,
    parse_memory,
)
from kvlayer.engine.loader import load_model, model_fingerprint
from kvlayer.engine.model_config import load_model_config
from kvlayer.engine.model_runner import ModelRunner, kv_bytes_per_block
from kvlayer.engine.outputs import CompletionOutput, RequestOutput
from kvlayer.engine.sampling import InvalidSamplingParam, Sampled, SamplingParams, sample_each
from kvlayer.engine.scheduler import Scheduler, StepPlan
from kvlayer.engine.sequence import Sequence as Seq
from kvlayer.engine.tokenizer import Tokenizer

PromptType = str | Mapping[str, Any]

log = logging.getLogger(__name__)


class _ConnectorHooks:
    """Routes the model's per-layer hooks to the connector's worker side."""

    def __init__(self, connector: KVConnectorBase) -> None:
        self.connector = connector

    def before_attention(self, layer: int) -> None:
        self.connector.wait_for_layer_load(layer)

    def after_attention(self, layer: int, kv_cache: torch.Tensor) -> None:
        self.connector.save_kv_layer(layer, kv_cache)


def load_connector(name: str, kv_config: Any, ctx: KVConnectorContext) -> KVConnectorBase:
    """The connector registered under ``name`` (entry-point group ``kvlayer.connectors``)."""
    found = {ep.name: ep for ep in entry_points(group="kvlayer.connectors")}
    if name not in found:
        raise ValueError(f"unknown kv connector {name!r}; installed: {sorted(found)}")
    return found[name].load()(kv_config, ctx)


def _blocks_in_budget(kv_cache_memory: int | None, per_block: int) -> int:
    """How many KV blocks of ``per_block`` bytes fit ``kv_cache_memory`` (None: the default)."""
    budget = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    if budget < per_block:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block of {per_block} bytes; "
                         f"raise kv_cache_memory or set num_gpu_blocks")
    return budget // per_block


class LLMEngine:
    """Requests in, tokens out, one ``step()`` at a time (for callers that control arrivals)."""

    def __init__(self, config: EngineConfig, kv_connector: KVConnectorBase | None = None,
                 kv_config: Any = None) -> None:
        self.config = config
        self.model_config = load_model_config(config.model)
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len)
        model, _ = load_model(config.model, config.dtype, config.device)
        self.tokenizer = Tokenizer.from_dir(config.model)
        num_blocks = config.num_gpu_blocks or _blocks_in_budget(
            config.kv_cache_memory, kv_bytes_per_block(cfg, config.block_size, config.dtype))
        self.runner = ModelRunner(model, cfg, num_blocks, config.block_size, config.dtype, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        if kv_connector is None and kv_config is not None:
            ctx = KVConnectorContext(
                model_name=cfg.model_name, model_fingerprint=model_fingerprint(config.model),
                num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                dtype=config.dtype, block_size=config.block_size, device=config.device,
                layer_windows=cfg.layer_windows if any(w is not None for w in cfg.layer_windows) else ())
            kv_connector = load_connector("kvlayer", kv_config, ctx)
        self.connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.runner.kv_caches)
        self._hooks = _ConnectorHooks(kv_connector) if kv_connector else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   kv_connector, cfg.attention_reach)
        self._ids = itertools.count()
        self._held: dict[str, Seq] = {}
        self._finished_ids: list[str] = []

    @property
    def num_blocks(self) -> int:
        return len(self.block_manager.blocks)

    # ----- requests ---------------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. ValueError for an empty, too long or invalid prompt;
        ``InvalidSamplingParam`` (a ValueError) for a stop token outside the vocabulary."""
        params = params or SamplingParams()
        text, ids, salt = self._parse_prompt(prompt)
        vocab = self.model_config.vocab_size
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidSamplingParam("stop_token_ids",
                                       f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of "
                             f"{self.max_model_len} tokens (one more is needed to generate)")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_needed(total) > self.num_blocks:
            raise ValueError(f"a request of {total} tokens needs more KV blocks than the cache's "
                             f"{self.num_blocks}; raise kv_cache_memory or num_gpu_blocks")
        rid = request_id if request_id is not None else str(next(self._ids))
        self.scheduler.add(Seq(rid, ids, params, salt, text, arrival_time))
        return rid

    def _parse_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer.json in the model folder; "
                                 "pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt), None
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt_token_ids", "prompt", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt keys {sorted(unknown)}")
            if "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict needs 'prompt_token_ids'")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError("cache_salt must be a string")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
        raise ValueError(f"a prompt is a string or a dict, got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> bool:
        """Stop ``request_id`` between steps, finished with reason ``"abort"``: its blocks go back
        to the block manager (cached prefix blocks stay cached, unreferenced) and the connector
        forgets it, as for any finished request. Returns whether it was unfinished."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held)

    # ----- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that produced a token in it."""
        self._release_saved()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        failed: dict[str, int] = {}
        if self.connector is not None:
            meta = self.connector.build_connector_meta(self._connector_view(plan))
            self.connector.start_load_kv(meta)
        logits = self.runner.execute(plan, self._hooks)
        if self.connector is not None:
            self.connector.wait_for_save()
            failed = self.connector.get_failed_loads()
        return self._postprocess(plan, logits, failed)

    def _connector_view(self, plan: StepPlan) -> SchedulerOutput:
        scheduled = tuple(
            ScheduledRequest(s.seq.request_id, s.seq.token_ids, s.seq.num_prompt_tokens,
                             tuple(s.seq.block_table), s.seq.num_computed_tokens, s.num_new, s.seq.cache_salt)
            for s in plan.all)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(scheduled, finished, self.config.block_size)

    def _postprocess(self, plan: StepPlan, logits: torch.Tensor, failed: dict[str, int]) -> list[RequestOutput]:
        sampling = [s.seq for s in plan.all if s.samples]
        drawn = sample_each(logits, [s.params for s in sampling], [s.generator for s in sampling],
                            [s.output_token_ids for s in sampling])
        drawn_of = {id(s): d for s, d in zip(sampling, drawn, strict=True)}
        now = time.perf_counter()
        outputs = []
        for item in plan.all:
            seq = item.seq
            if seq.request_id in failed:
                valid = min(failed[seq.request_id], seq.num_computed_tokens)
                self.block_manager.uncommit_from(seq, valid)
                seq.num_computed_tokens = valid
                seq.partial_kv_before = min(seq.partial_kv_before, valid)  # recomputed from there
                seq.num_external_tokens = max(0, min(seq.num_external_tokens, valid - seq.num_cached_tokens))
                continue
            seq.num_computed_tokens += item.num_new
            self.block_manager.commit(seq)
            result = drawn_of.get(id(seq))
            if result is None:
                continue
            if result.token is None:
                self._fail(seq, result)
            else:
                self._advance(seq, result.token, now)
            outputs.append(self._output(seq))
        return outputs

    def _advance(self, seq: Seq, token: int, now: float) -> None:
        seq.token_ids.append(token)
        if seq.times.first_token_time is None:
            seq.times.first_token_time = now
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)

    def _fail(self, seq: Seq, result: Sampled) -> None:
        """Finish ``seq`` alone with reason "error"; after a model fault the blocks only it holds
        are zeroed before they are freed (``_free``)."""
        log.warning("request %s failed: %s", seq.request_id, result.error)
        seq.error = result.error
        seq.scrub_kv = result.model_fault
        self._finish(seq, "error")

    def _stop_reason(self, seq: Seq, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Seq, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._finished_ids.append(seq.request_id)
        hold = False
        if self.connector is not None:
            hold = self.connector.request_finished(seq, tuple(seq.block_table))
        if hold:
            self._held[seq.request_id] = seq
        else:
            self._free(seq)

    def _free(self, seq: Seq) -> None:
        if seq.scrub_kv:
            self.runner.zero_blocks(self.block_manager.forget_sole_blocks(seq))
        self.block_manager.free_seq(seq)

    def _release_saved(self) -> None:
        if self.connector is None or not self._held:
            return
        for rid in self.connector.get_finished():
            seq = self._held.pop(rid, None)
            if seq is not None:
                self._free(seq)

    def _output(self, seq: Seq) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else None
        done = seq.is_finished
        comp = CompletionOutput(0, tuple(seq.output_token_ids), text, seq.finish_reason, seq.error)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, (comp,), done,
                             seq.num_cached_tokens, seq.num_external_tokens, seq.times)

    def reset_prefix_cache(self) -> None:
        """Forget the engine's own prefix cache (kvlayer's tiers are untouched)."""
        self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


class LLM:
    """vLLM-shaped entry point: ``LLM(model=PATH).generate(prompts, SamplingParams(...))``.

    ``device`` "cpu", "cuda" or "cuda:N" (ValueError naming it when this torch build or machine
    has no such device); ``dtype`` "float32" | "bfloat16" | "float16" (default: the
    model's, float32 on CPU); the KV cache holds ``num_gpu_blocks`` blocks or as many as fit
    ``kv_cache_memory`` (e.g. "2GiB"; default 1GiB). ``kv_connector`` plugs in a connector
    object; ``kv_config`` (a path to YAML, a dict or a ``KVLayerConfig``) enables kvlayer.
    """

    def __init__(self, model: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 block_size: int = 16, num_gpu_blocks: int | None = None,
                 kv_cache_memory: int | str | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 4096, max_model_len: int | None = None,
                 kv_connector: KVConnectorBase | None = None, kv_config: Any = None) -> None:
        dev = parse_device(device)
        default_dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        config = EngineConfig(model=str(model), device=dev, dtype=parse_engine_dtype(dtype, default_dtype),
                              block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                              kv_cache_memory=parse_memory(kv_cache_memory),
                              enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        self.engine = LLMEngine(config, kv_connector, kv_config)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts`` (a request that
        failed alone is among them, finished with reason "error" and its ``error``)."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def kv_stats(self) -> dict[str, Any]:
        """kvlayer's per-tier counters as plain data ({} without a kvlayer connector)."""
        stats = getattr(self.engine.connector, "stats", None)
        return stats() if callable(stats) else {}

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
