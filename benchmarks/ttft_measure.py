"""The measurements behind ``kvlayer bench ttft``: one engine at a time, every prefix length through it.

Prompts: for prefix length n, ``full(n)`` is n tokens plus ``suffix`` new ones; ``partial(n)``
shares the first n/2 tokens with ``full(n)`` (so they are already stored when it runs) and
continues with fresh tokens to the same length: half the prompt cached, the rest computed.

Before every kvlayer hit, ``isolate`` leaves the chunk in the measured tier alone: background
writes finished, the CPU tier emptied when NVMe sits below it (``cpu+nvme`` is an NVMe hit
through the CPU tier, promotion included), and the NVMe files dropped from the OS page cache
(so an NVMe hit reads the disk, not memory).

Every request generates one greedy token; recompute's and each hit's are kept (``cold_token``,
``hit_token``: the first token only) for ``ttft_storage`` to compare, which also measures what
the variant's lowest tier holds per token once its prompts ran.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvlayer.benchmarks.configs import BenchConfig, drop_page_cache, make_llm, tier_hit_tokens
from kvlayer.benchmarks.ttft_storage import Stored, stored_bytes

WARMUP_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Prompts:
    """The prompts of one prefix length ``n`` (see the module docstring); ``k`` picks one of
    several variants for repeated measurements (each variant is new to every cache)."""

    n: int
    full: list[int]
    suffix: int
    vocab: int

    def partial(self, k: int = 0) -> list[int]:
        """``full``'s first n/2 tokens, then fresh tokens up to ``full``'s length."""
        rest = random.Random(f"partial-{self.n}-{k}")
        return self.full[: self.n // 2] + [rest.randrange(3, self.vocab) for _ in range(len(self.full) - self.n // 2)]

    def sibling(self, k: int = 0) -> list[int]:
        """``full``'s first n tokens and another suffix: an engine prefix-cache hit on it
        computes exactly the tokens a kvlayer hit on ``full`` computes (a hit on ``full``
        itself would reuse its suffix's full blocks too)."""
        other = random.Random(f"sibling-{self.n}-{k}")
        return self.full[: self.n] + [other.randrange(3, self.vocab) for _ in range(self.suffix)]


def make_prompts(n: int, suffix: int, vocab: int) -> Prompts:
    rng = random.Random(n)
    return Prompts(n, [rng.randrange(3, vocab) for _ in range(n + suffix)], suffix, vocab)


def median_of(repeat: int, measure: Callable[[int], float | None]) -> float | None:
    """The median of ``measure(k)`` for k in ``range(repeat)`` (None if any is None)."""
    values = [measure(k) for k in range(repeat)]
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[type-var]


def first_token(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token of ``prompt`` (one request, greedy), and that token."""
    from kvlayer.engine import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))[0]
    return out.metrics.ttft, out.outputs[0].token_ids[0]


def ttft(llm: Any, prompt: list[int]) -> float:
    """Seconds from submission to the first token of ``prompt`` (one request, greedy)."""
    return first_token(llm, prompt)[0]


def open_llm(model: str, device: str, config: BenchConfig, max_len: int) -> Any:
    """An engine for prompts up to ``max_len`` tokens (prefilled in one step), warmed up."""
    llm = make_llm(model, device, config, num_gpu_blocks=-(-max_len // 16) + 2, max_num_batched_tokens=max_len)
    vocab = llm.engine.model_config.vocab_size
    ttft(llm, [random.Random(-1).randrange(3, vocab) for _ in range(WARMUP_TOKENS)])
    return llm


def cache_engine(llm: Any) -> Any:
    """The ``KVCacheEngine`` behind an LLM's kvlayer connector (None without one)."""
    return getattr(llm.engine.connector, "kv", None)


def isolate(llm: Any, config: BenchConfig) -> None:
    """Leave the stored chunks only in the tier ``config`` measures (see the module docstring)."""
    ce = cache_engine(llm)
    if ce is None:
        return
    ce.flush()
    if config.nvme_path and config.has_cpu_tier:
        ce.evict_all("cpu")
    drop_page_cache(config.nvme_path)


def pure_load(llm: Any, tokens: list[int]) -> float | None:
    """Seconds to retrieve ``tokens``' chunks from the tiers into the engine's paged cache with no
    compute (blocks from 0 up, the engine being idle); None if not all of them came back."""
    from kvlayer.transfer import slot_mapping

    ce = cache_engine(llm)
    if ce is None or not tokens:
        return None
    eng = llm.engine
    bs = eng.config.block_size
    slots = slot_mapping(range(-(-len(tokens) // bs)), bs, 0, len(tokens), eng.config.device)
    t = time.perf_counter()
    got = ce.retrieve(tokens, eng.runner.kv_caches, slots)
    dt = time.perf_counter() - t
    return dt if got == len(tokens) else None


def measure_baselines(model: str, device: str, prompts: list[Prompts], partial: bool, max_len: int,
                      configs: dict[str, BenchConfig], advance: Any, repeat: int = 1) -> dict[int, dict[str, Any]]:
    """Per prefix length: ``cold_s`` and ``cold_token`` (recompute's TTFT and greedy token) and
    ``suffix_s`` (an engine prefix-cache hit on ``sibling``: the n-token prefix reused, the
    suffix computed alone; median of ``repeat``), and with ``partial`` the same for ``partial(n)``."""
    out: dict[int, dict[str, Any]] = {p.n: {} for p in prompts}
    with open_llm(model, device, configs["recompute"], max_len) as llm:
        for p in prompts:
            out[p.n]["cold_s"], out[p.n]["cold_token"] = first_token(llm, p.full)
            if partial:
                out[p.n]["partial_cold_s"], out[p.n]["partial_cold_token"] = first_token(llm, p.partial())
            advance(1)
    with open_llm(model, device, configs["engine"], max_len) as llm:
        for p in prompts:
            out[p.n]["engine_miss_s"] = ttft(llm, p.full)
            out[p.n]["suffix_s"] = median_of(repeat, lambda k, p=p: ttft(llm, p.sibling(k)))
            if partial:
                out[p.n]["partial_engine_s"] = median_of(repeat, lambda k, p=p: ttft(llm, p.partial(k)))
            advance(1)
    return out


def _hit(llm: Any, config: BenchConfig, prompt: list[int]) -> tuple[float, dict[str, int], int, int]:
    """TTFT of ``prompt`` after ``isolate``, the tokens each tier served for it, its greedy token
    and the KV bytes its load wrote into the engine's cache (``loaded_bytes``)."""
    isolate(llm, config)
    stats = llm.kv_stats()
    before, loaded = tier_hit_tokens(stats), stats["loaded_tokens"]
    t, token = first_token(llm, prompt)
    stats = llm.kv_stats()
    after = tier_hit_tokens(stats)
    moved = loaded_bytes(cache_engine(llm).layout, stats["loaded_tokens"], loaded)
    return t, {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}, token, moved


def loaded_bytes(layout: Any, after: dict[str, int], before: dict[str, int]) -> int:
    """KV bytes loaded between two ``kv_stats()["loaded_tokens"]``: each window group's new tokens
    times its layers' bytes per token (a window-aware load of a sliding-window model moves a
    window layer's KV for the window only, ``kvlayer.windows``)."""
    per_layer = layout.bytes_per_token // layout.num_layers
    layers = {g.name: len(g.layers) for g in layout.window_groups}
    return sum((n - before.get(g, 0)) * layers.get(g, layout.num_layers) * per_layer for g, n in after.items())


class VariantRun(NamedTuple):
    """``measure_variant``'s answer: a row per prefix length, and what the configuration's lowest
    tier held per token at the end (None for a memory tier; see ``ttft_storage.stored_bytes``),
    and its hit verification counters at the end (``verified_hits``, ``verify_mismatches``)."""

    rows: list[dict[str, Any]]
    stored: Stored | None
    verified: dict[str, int]


def measure_variant(model: str, device: str, config: BenchConfig, prompts: list[Prompts], partial: bool,
                    chunk: int, max_len: int, advance: Any, repeat: int = 1) -> VariantRun:
    """Per prefix length under one kvlayer configuration: the first (all-miss) request, the hit
    and its greedy token, the pure load of the cached prefix and, with ``partial``, the
    half-cached prompt's hit and load; hits and loads are medians of ``repeat`` (partial hits on
    new variants each time); then the bytes per token its lowest tier holds."""
    rows = []
    with open_llm(model, device, config, max_len) as llm:
        for p in prompts:
            rows.append(_measure_length(llm, config, p, chunk, partial, repeat))
            advance(1)
        ce = cache_engine(llm)
        ce.flush()
        stored = stored_bytes(llm, config, len(ce.layout.window_groups))
        stats = llm.kv_stats()
        verified = {k: int(stats.get(k, 0)) for k in ("verified_hits", "verify_mismatches")}
    return VariantRun(rows, stored, verified)


def _measure_length(llm: Any, config: BenchConfig, p: Prompts, chunk: int, partial: bool,
                    repeat: int) -> dict[str, Any]:
    """``measure_variant``'s row for one prefix length."""
    tiers: dict[str, dict[str, int]] = {}
    tokens: dict[str, int] = {}

    moved: dict[str, int] = {}

    def hit(prompt: list[int], case: str) -> float:
        t, tiers[case], token, moved[case] = _hit(llm, config, prompt)
        tokens.setdefault(case, token)  # the first prompt's: partial(0), the one recompute ran
        return t

    def load(tokens: list[int]) -> float | None:
        isolate(llm, config)
        return pure_load(llm, tokens)

    cached = p.n // chunk * chunk
    row: dict[str, Any] = {"prefix": p.n, "cached": cached, "miss_s": ttft(llm, p.full)}
    row["hit_s"] = median_of(repeat, lambda _k: hit(p.full, "full"))
    row["hit_tiers"], row["hit_token"], row["loaded_bytes"] = tiers["full"], tokens["full"], moved["full"]
    row["load_s"] = median_of(repeat, lambda _k: load(p.full[:cached]))
    if partial:
        half = row["partial_cached"] = p.n // 2 // chunk * chunk
        row["partial_hit_s"] = median_of(repeat, lambda k: hit(p.partial(k), "partial"))
        row["partial_tiers"], row["partial_hit_token"] = tiers["partial"], tokens["partial"]
        row["partial_load_s"] = median_of(repeat, lambda _k: load(p.full[:half]))  # the partial prompts' cached half
    return row


CEILING_OF = {"cpu": "memcpy", "nvme": "nvme_cold", "cpu+nvme": "nvme_cold", "redis": "redis_get"}
"""The raw ceiling that bounds each configuration's load (``tier_ceilings``)."""


def tier_ceilings(names: list[str], folder: str, redis_url: str | None, nbytes: int,
                  chunk_bytes: int) -> dict[str, float]:
    """Bytes/s of each raw ceiling the configurations ``names`` (without quantization) need (``CEILING_OF``), for
    ``nbytes`` in ``chunk_bytes`` pieces: torch copies, cold sequential file reads under
    ``folder`` (left out where the page cache cannot be dropped), pipelined redis-py GETs."""
    from kvlayer.benchmarks import tier_ceilings as raw

    need = {CEILING_OF[n] for n in names if n in CEILING_OF}
    count = max(1, nbytes // max(chunk_bytes, 1))
    out = {"memcpy": raw.memcpy_rate(count, chunk_bytes, 3) * raw.GIB}
    if "nvme_cold" in need:
        cold = raw.file_rates(folder, count, chunk_bytes, 3)["get_cold"]
        if cold:
            out["nvme_cold"] = cold * raw.GIB
    if "redis_get" in need and redis_url:
        out["redis_get"] = raw.redis_rates(redis_url, count, chunk_bytes, 3)["get"] * raw.GIB
    return out
