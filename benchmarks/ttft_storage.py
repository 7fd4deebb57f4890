"""The storage side of ``kvlayer bench ttft``: what the measured tier holds per token, and each
configuration against exact storage and against recompute.

- ``stored_bytes``: the bytes a configuration's lowest tier holds over the tokens they cover,
  measured once its prompts ran (NVMe: the sizes of its folder's chunk files; Redis: the bytes
  kvlayer wrote there, each chunk's header and payload, before Redis's own per-key overhead,
  which ``bench tiers`` reports). A hybrid model stores one object per window group of each
  chunk (``kvlayer.windows.save_keys``), so objects over groups are the chunks. Memory tiers
  hold exact tensors and are not measured.
- ``compare``: per kvlayer variant, whether each prompt's greedy first token equals
  recompute's (``bench ttft`` generates one token per request: this says nothing about later
  tokens) and, for a quantized variant (``nvme:int8``), its hit TTFT, pure load and bytes per
  token over those of the exact variant of the same configuration and loading mode measured in
  the same run (None where that one was not in ``--configs``).
- ``print_storage`` and ``plot_vs_exact``: the table and the plot panel of those figures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from kvlayer.benchmarks.common import print_table
from kvlayer.benchmarks.configs import BenchConfig
from kvlayer.benchmarks.stats import ratio


class Stored(NamedTuple):
    """What one tier held: ``nbytes`` in ``chunks`` chunks of ``chunk_size`` tokens (every layer's KV)."""

    tier: str
    nbytes: int
    chunks: int
    chunk_size: int

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / (self.chunks * self.chunk_size)

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "bytes": self.nbytes, "chunks": self.chunks, "bytes_per_token": self.bytes_per_token}


def _nvme_files(llm: Any, config: BenchConfig) -> tuple[int, int]:
    files = [f.stat().st_size for f in Path(config.nvme_path or "").rglob("*.kvc")]  # one file per object
    return sum(files), len(files)


def _redis_written(llm: Any, config: BenchConfig) -> tuple[int, int]:
    backend = llm.kv_stats()["tiers"]["redis"]["backend"]
    return int(backend["bytes_written"]), int(backend["puts"])


_HOLDINGS: dict[str, Callable[[Any, BenchConfig], tuple[int, int]]] = {"nvme": _nvme_files, "redis": _redis_written}
"""Lowest tier -> ``(bytes, objects)`` it holds, for an LLM running the configuration."""


def stored_bytes(llm: Any, config: BenchConfig, objects_per_chunk: int = 1) -> Stored | None:
    """What ``config``'s lowest tier holds in ``llm`` (a ``kvlayer.engine.LLM`` running it, its
    writes flushed), each chunk stored as ``objects_per_chunk`` objects (its layout's window
    groups); None for a memory tier, or when it holds no chunk."""
    measure = _HOLDINGS.get(config.lowest_tier or "")
    if measure is None or config.kv_config is None:
        return None
    nbytes, objects = measure(llm, config)
    chunks = objects // objects_per_chunk
    return Stored(config.lowest_tier or "", nbytes, chunks, int(config.kv_config["chunk_size"])) if chunks else None


FIRST_TOKEN_NOTE = "the first generated token only (bench ttft generates one greedy token per request)"


def compare(variants: dict[str, dict[str, Any]], base: dict[int, dict[str, Any]]) -> None:
    """Add to each of ``build_record``'s ``variants`` (label -> record, updated in place) its
    first-token agreement with recompute (``base``: the baselines per prefix length) and, when
    quantized, its figures over the exact variant's (see the module docstring)."""
    exact = {(v["config"], v["layerwise"]): label for label, v in variants.items() if v["quantization"] == "none"}
    for v in variants.values():
        _agreement(v, base)
        if v["quantization"] == "none":
            continue
        label = exact.get((v["base"], v["layerwise"]))
        e = variants[label] if label is not None else None
        v["exact"] = label
        v["stored_vs_exact"] = ratio(v["stored_bytes_per_token"], e["stored_bytes_per_token"] if e else None)
        for i, r in enumerate(v["by_length"]):
            er = e["by_length"][i] if e is not None else {}
            r["hit_vs_exact"] = ratio(r["hit_s"], er.get("hit_s"))
            r["load_vs_exact"] = ratio(r["load_s"], er.get("load_s"))


def _agreement(v: dict[str, Any], base: dict[int, dict[str, Any]]) -> None:
    """Per row ``first_token_matches`` (and ``partial_first_token_matches``): the hit's greedy
    token equals recompute's (None where recompute has none); per variant their tally."""
    matched = compared = 0
    for r in v["by_length"]:
        b = base[r["prefix"]]
        for key, ref in (("", "cold_token"), ("partial_", "partial_cold_token")):
            if f"{key}hit_token" not in r:
                continue
            same = r[f"{key}hit_token"] == b[ref] if ref in b else None
            r[f"{key}first_token_matches"] = same
            if same is not None:
                matched, compared = matched + same, compared + 1
    v["first_token"] = {"matches": matched, "prompts": compared,
                        "share": matched / compared if compared else None, "note": FIRST_TOKEN_NOTE}


def quantized(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The quantized variants of a ``bench ttft`` record, by label."""
    return {label: v for label, v in record["variants"].items() if v["quantization"] != "none"}


def print_storage(record: dict[str, Any]) -> None:
    """With a quantized variant in ``record``: per prefix length and variant, bytes per token held,
    hit TTFT against exact storage and the first token against recompute; nothing otherwise."""
    if not quantized(record):
        return
    rows = []
    for n in record["lengths"]:
        for label, v in record["variants"].items():
            r = next(r for r in v["by_length"] if r["prefix"] == n)
            same = [r[k] for k in ("first_token_matches", "partial_first_token_matches") if r.get(k) is not None]
            rows.append([n, label, v["quantization"], v["stored_bytes_per_token"], v.get("stored_vs_exact"),
                         r["hit_s"], r.get("hit_vs_exact"), r["load_s"], r.get("load_vs_exact"),
                         f"{sum(same)}/{len(same)}" if same else None])
    print_table("quantized storage: bytes per token the tier holds; hit and load against exact storage "
                "(same tier, same run)",
                ["prefix", "config", "quant", "B/tok", "B/tok vs exact", "hit TTFT s", "hit vs exact", "load s",
                 "load vs exact", "1st token = recompute"], rows)
    tallies = ", ".join(f"{label} {v['first_token']['matches']}/{v['first_token']['prompts']}"
                        for label, v in record["variants"].items())
    print(f"first token = recompute: {FIRST_TOKEN_NOTE}, over recompute's: {tallies}")


def plot_vs_exact(ax: Any, record: dict[str, Any]) -> None:
    """One panel: each quantized variant's hit TTFT over its exact variant's, per prefix length."""
    for label, v in quantized(record).items():
        ys = [r.get("hit_vs_exact") for r in v["by_length"]]
        if any(y is not None for y in ys):
            ax.plot(record["lengths"], ys, marker=".", label=f"{label} / {v['exact']}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="hit TTFT / exact storage's", title="quantized storage against exact (same run)")
