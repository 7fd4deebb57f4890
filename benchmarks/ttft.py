"""``kvlayer bench ttft``: time to first token of a prompt whose prefix is cached, per configuration.

For each prefix length n (the prompt is n cached tokens + ``--suffix`` new ones), in one run:

- ``recompute``: no cache, the whole prompt computed (cold);
- ``engine``: the engine's own prefix-cache hit, i.e. the suffix computed alone;
- each kvlayer configuration (engine prefix cache off, so the prefix comes from kvlayer): the
  first request (an all-miss that computes and stores: kvlayer's overhead on misses), the hit
  with the chunks only in the measured tier (see ``ttft_measure``), the pure load time of the
  prefix (no compute), and the *floor*: KV bytes over the raw ceiling of the configuration's
  tier measured in this run (memcpy for cpu, cold sequential file reads for nvme, pipelined
  redis-py GETs for redis) plus the suffix's compute time;
- ``--partial``: a prompt of the same length with only its first half cached;
- ``--layerwise both``: every kvlayer configuration with and without layer-by-layer loading,
  and the overlap ratio: layerwise TTFT / max(pure load, suffix compute) (1.0 = perfect
  overlap) and / (load + suffix) (1.0 = no overlap at all), for the full hit and, with
  ``--partial``, for the half-cached prompt;
- per configuration, the crossover prefix length below which recomputing beats loading;
- ``--verify``: every kvlayer configuration also with ``verify_fraction`` 1.0, where each hit
  is recomputed and compared with the stored chunks (``ttft_verify``): what a verified hit
  costs over recompute, and the mean TTFT at production sampling rates;
- quantized storage (``nvme:int8``, ``redis:fp8``, ...: ``configs.parse_name``): the same
  figures, with the floor over the bytes the tier holds, plus (``ttft_storage``) the bytes per
  token its tier holds, its hit TTFT and load over the exact configuration's of the same run,
  and per prompt whether its first greedy token equals recompute's.

Example: ``kvlayer bench ttft --lengths 256,1024,4096 --configs recompute,engine,cpu,nvme,nvme:int8 --plot ttft.png``
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlayer.benchmarks import ttft_measure as tm
from kvlayer.benchmarks import ttft_storage as ts
from kvlayer.benchmarks import ttft_verify as tv
from kvlayer.benchmarks.common import (
    add_plot_argument,
    close_figure,
    default_model,
    machine_info,
    model_facts,
    new_figure,
    positive_int,
    positive_ints,
    print_table,
    progress,
    save_figure,
    settings_of,
    write_json,
)
from kvlayer.benchmarks.configs import BASELINES, BenchConfig, add_config_arguments, factory_from_args, parse_configs
from kvlayer.benchmarks.stats import crossover, ratio

LAYERWISE = {"on": (True,), "off": (False,), "both": (True, False)}
WINDOW_AWARE = LAYERWISE
"""``--window-aware``: kvlayer's window-aware loads on a sliding-window model, full-KV loads, or both."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=positive_ints, default="256,512,1024,2048,4096",
                   help="cached prefix lengths, ascending (also the sweep for the crossover)")
    p.add_argument("--suffix", type=positive_int, default=32, help="new tokens after the cached prefix")
    p.add_argument("--partial", action="store_true", help="also measure prompts with half of them cached")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="measure each hit and load this many times and report the median")
    p.add_argument("--layerwise", choices=sorted(LAYERWISE), default="both",
                   help="kvlayer's layer-by-layer loading: on, off, or both compared")
    p.add_argument("--window-aware", choices=sorted(WINDOW_AWARE), default="on",
                   help="on a model with sliding windows (--model): kvlayer's window-aware loads, full-KV "
                        "loads (off), or both compared")
    p.add_argument("--verify", action="store_true",
                   help="also run each kvlayer configuration with verify_fraction 1.0 (every hit recomputed and "
                        "compared with the stored KV) and report what hit verification costs")
    add_config_arguments(p)
    add_plot_argument(p)


def main(args: argparse.Namespace) -> int:
    lengths = args.lengths
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"--lengths must be ascending, got {','.join(map(str, lengths))}")
    names = parse_configs(args.configs)
    model = args.model or default_model(args.home, "bench")
    max_len = max(lengths) + args.suffix
    facts = model_facts(model, args.device)
    per_token = facts["kv_bytes_per_token"]
    prompts = [tm.make_prompts(n, args.suffix, facts["vocab"]) for n in lengths]
    with factory_from_args(args, names, kvlayer_prefix_caching=False) as factory:
        names = factory.available(names)
        kv_names = [n for n in names if n not in BASELINES]
        variants = [factory.build(n, lw, _label(n, lw, wa, args), window_aware=wa)
                    for n in kv_names for lw in LAYERWISE[args.layerwise] for wa in WINDOW_AWARE[args.window_aware]]
        if args.verify:
            variants += [factory.build(v.name, v.kv_config["layerwise"], f"{v.label} {tv.SUFFIX}",
                                       window_aware=v.kv_config.get("window_aware", True), verify_fraction=1.0)
                         for v in list(variants)]
        baselines = {n: factory.build(n) for n in BASELINES}
        with progress(len(lengths) * (2 + len(variants)), "ttft") as advance:
            base = tm.measure_baselines(model, args.device, prompts, args.partial, max_len, baselines, advance,
                                        args.repeat)
            runs = {v.label: tm.measure_variant(model, args.device, v, prompts, args.partial, args.chunk_size,
                                                max_len, advance, args.repeat) for v in variants}
        ceilings = tm.tier_ceilings(list(dict.fromkeys(v.base for v in variants)), factory.root, factory.redis_url,
                                    max(lengths) * per_token, args.chunk_size * per_token)
    record = build_record(args, facts, lengths, ceilings, base, variants, runs)
    report(record)
    write_json(args.json, record)
    plot(args.plot, record)
    return 0


def _label(name: str, layerwise: bool, window_aware: bool, args: argparse.Namespace) -> str:
    """``name``, with ``lw=``/``wa=`` where both modes of that setting run."""
    label = name
    if len(LAYERWISE[args.layerwise]) > 1:
        label += f" lw={'on' if layerwise else 'off'}"
    if len(WINDOW_AWARE[args.window_aware]) > 1:
        label += f" wa={'on' if window_aware else 'off'}"
    return label


def windows(variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each configuration run window-aware and with full KV (same layerwise mode), per length:
    both hits' TTFT and loaded KV bytes, and aware / full of each."""
    pairs: dict[tuple[str, bool], dict[bool, dict[str, Any]]] = {}
    for v in variants.values():
        pairs.setdefault((v["config"], v["layerwise"]), {})[v["window_aware"]] = v
    out = []
    for (name, layerwise), pair in pairs.items():
        if set(pair) != {True, False}:
            continue
        for aware, full in zip(pair[True]["by_length"], pair[False]["by_length"]):
            out.append({"config": name, "layerwise": layerwise, "prefix": aware["prefix"],
                        "aware_s": aware["hit_s"], "full_s": full["hit_s"], "ttft_ratio": ratio(aware["hit_s"],
                                                                                                full["hit_s"]),
                        "aware_bytes": aware["loaded_bytes"], "full_bytes": full["loaded_bytes"],
                        "bytes_ratio": ratio(aware["loaded_bytes"], full["loaded_bytes"])})
    return out


def build_record(args: argparse.Namespace, facts: dict[str, Any], lengths: list[int], ceilings: dict[str, float],
                 base: dict[int, dict[str, Any]], variants: list[BenchConfig],
                 runs: dict[str, tm.VariantRun]) -> dict[str, Any]:
    """The JSON record: baselines and floors per length, per variant its rows, crossover, bytes
    per token stored and the comparisons of ``ttft_storage.compare``, and the layerwise overlap
    when both modes ran. A row's floor is its KV bytes (for quantized storage: the bytes its tier
    holds) over the raw ceiling of its tier (``ttft_measure.CEILING_OF``; memcpy when that one was
    not measured) plus the suffix's compute; the baseline's floor uses memcpy."""
    per_token = facts["kv_bytes_per_token"]
    bandwidth = ceilings["memcpy"]
    for n, b in base.items():
        cached = n // args.chunk_size * args.chunk_size
        b["kv_bytes"] = cached * per_token
        b["floor_s"] = cached * per_token / bandwidth + b["suffix_s"]
    out_variants = {}
    for v in variants:
        ceiling = ceilings.get(tm.CEILING_OF.get(v.base, "memcpy"), bandwidth)
        rows, stored, verified = runs[v.label]
        moved = stored.bytes_per_token if stored is not None and v.quantization != "none" else per_token
        for r in rows:
            b = base[r["prefix"]]
            r["speedup"] = ratio(b["cold_s"], r["hit_s"])
            r["miss_overhead"] = r["miss_s"] / b["cold_s"] - 1
            r["floor_s"] = r["cached"] * moved / ceiling + b["suffix_s"]
            r["hit_over_floor"] = ratio(r["hit_s"], r["floor_s"])
            if "partial_hit_s" in r:
                r["partial_speedup"] = ratio(b["partial_cold_s"], r["partial_hit_s"])
        cross = crossover(lengths, [base[n]["cold_s"] for n in lengths], [r["hit_s"] for r in rows])
        out_variants[v.label] = {"config": v.name, "base": v.base, "quantization": v.quantization,
                                 "layerwise": v.kv_config["layerwise"], "kv_config": v.public_kv_config(),
                                 "window_aware": v.kv_config.get("window_aware", True),
                                 "verify_fraction": v.kv_config.get("verify_fraction", 0.0), "verified": verified,
                                 "stored": stored.to_json() if stored is not None else None,
                                 "stored_bytes_per_token": stored.bytes_per_token if stored is not None else None,
                                 "by_length": rows,
                                 "crossover": {"length": cross.length, "kind": cross.kind, "text": cross.text()}}
    ts.compare(out_variants, base)
    return {"bench": "ttft", "machine": machine_info(args.device), "model": facts,
            "settings": settings_of(args),
            "ceilings_gib_s": {k: v / 2**30 for k, v in ceilings.items()}, "lengths": lengths,
            "baselines": {str(n): b for n, b in base.items()}, "variants": out_variants,
            "layerwise": overlap(out_variants, base), "window_aware": windows(out_variants),
            "verification": tv.compare(out_variants, base)}


def overlap(variants: dict[str, dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each configuration run both ways, per length: layerwise TTFT against the pure load
    time and the suffix compute time (``ratio_max`` 1.0 = perfect overlap, ``ratio_sum`` 1.0 = none),
    for the full hit and, when measured, the partial one (its suffix: the engine computing the
    uncached half over the cached one)."""
    pairs: dict[str, dict[bool, dict[str, Any]]] = {}
    for v in variants.values():
        pairs.setdefault(v["config"], {})[v["layerwise"]] = v
    out = []
    for name, pair in pairs.items():
        if set(pair) != {True, False}:
            continue
        for on, off in zip(pair[True]["by_length"], pair[False]["by_length"]):
            b = base[on["prefix"]]
            cases = [("full", "", b["suffix_s"])]
            if "partial_hit_s" in on:
                cases.append(("partial", "partial_", b["partial_engine_s"]))
            for case, key, suffix in cases:
                load, hit = on[f"{key}load_s"], on[f"{key}hit_s"]
                out.append({"config": name, "prefix": on["prefix"], "case": case, "layerwise_s": hit,
                            "whole_s": off[f"{key}hit_s"], "load_s": load, "suffix_s": suffix,
                            "ratio_max": ratio(hit, max(load, suffix) if load is not None else None),
                            "ratio_sum": ratio(hit, load + suffix if load is not None else None)})
    return out


def report(record: dict[str, Any]) -> None:
    """Print the TTFT table, the partial-hit and layerwise tables when measured, and the crossovers."""
    rows = []
    for n_str, b in record["baselines"].items():
        n = int(n_str)
        rows.append([n, "recompute", b["cold_s"], 1.0, None, None, None, "-"])
        rows.append([n, "engine", b["suffix_s"], b["cold_s"] / b["suffix_s"], None, None, None, "engine"])
        for label, v in record["variants"].items():
            r = next(r for r in v["by_length"] if r["prefix"] == n)
            rows.append([n, label, r["hit_s"], r["speedup"], 100 * r["miss_overhead"], r["load_s"],
                         r["hit_over_floor"], _tiers(r["hit_tiers"])])
        rows.append([n, "floor", b["floor_s"], b["cold_s"] / b["floor_s"], None, None, None, "-"])
    m = record["model"]
    ceilings = ", ".join(f"{k} {v:.2f}" for k, v in record["ceilings_gib_s"].items())
    print_table(f"bench ttft: {m['name']} ({m['layers']} layers), raw ceilings GiB/s: {ceilings}",
                ["prefix", "config", "TTFT s", "speedup", "miss +%", "load s", "hit/floor", "served by"], rows)
    if any("partial_cold_s" in b for b in record["baselines"].values()):
        prow = []
        for n_str, b in record["baselines"].items():
            prow.append([int(n_str), "recompute", 0, b["partial_cold_s"], 1.0])
            prow.append([int(n_str), "engine", int(n_str) // 2, b["partial_engine_s"],
                         b["partial_cold_s"] / b["partial_engine_s"]])
            for label, v in record["variants"].items():
                r = next(r for r in v["by_length"] if r["prefix"] == int(n_str))
                prow.append([int(n_str), label, r["partial_cached"], r["partial_hit_s"], r["partial_speedup"]])
        print_table("partial hit: half of the prompt cached", ["prompt", "config", "cached", "TTFT s", "speedup"],
                    prow)
    if record["layerwise"]:
        print_table("layer-by-layer loading: overlap of load and compute",
                    ["config", "prompt", "cached", "layerwise s", "whole s", "load s", "suffix s", "lw/max",
                     "lw/sum"],
                    [[o["config"], o["prefix"], o["case"], o["layerwise_s"], o["whole_s"], o["load_s"], o["suffix_s"],
                      o["ratio_max"], o["ratio_sum"]] for o in record["layerwise"]])
        print("lw/max = layerwise TTFT / max(load, suffix compute): 1.0 is perfect overlap; "
              "lw/sum = / (load + suffix): 1.0 is no overlap")
    if record["window_aware"]:
        print_table("sliding windows: window-aware loads against full-KV loads (hits)",
                    ["config", "layerwise", "prefix", "aware s", "full s", "aware/full", "aware MiB", "full MiB",
                     "bytes aware/full"],
                    [[w["config"], w["layerwise"], w["prefix"], w["aware_s"], w["full_s"], w["ttft_ratio"],
                      w["aware_bytes"] / 2**20, w["full_bytes"] / 2**20, w["bytes_ratio"]]
                     for w in record["window_aware"]])
    ts.print_storage(record)
    tv.report(record)
    print("crossover: the cached prefix length below which recomputing is cheaper than loading")
    for label, v in record["variants"].items():
        print(f"  {label}: {v['crossover']['text']} tokens")


def _tiers(tiers: dict[str, int]) -> str:
    return " ".join(f"{t}:{n}" for t, n in tiers.items()) or "none"


def plot(path: str | None, record: dict[str, Any]) -> None:
    if not path:
        return
    lengths = record["lengths"]
    base = [record["baselines"][str(n)] for n in lengths]
    quantized = bool(ts.quantized(record))
    fig, axes = new_figure(1, 3 if quantized else 2, (19 if quantized else 13, 4.8))
    ax, ax_s = axes[0][:2]
    ax.plot(lengths, [b["cold_s"] for b in base], "k-o", label="recompute")
    ax.plot(lengths, [b["suffix_s"] for b in base], "k--", label="engine hit")
    ax.plot(lengths, [b["floor_s"] for b in base], ":", color="0.5", label="floor")
    for label, v in record["variants"].items():
        hits = [r["hit_s"] for r in v["by_length"]]
        ax.plot(lengths, hits, marker=".", label=label)
        ax_s.plot(lengths, [r["speedup"] for r in v["by_length"]], marker=".", label=label)
    ax.set(yscale="log", ylabel="TTFT s", title="TTFT")
    ax_s.axhline(1.0, color="k", lw=0.8)
    ax_s.set(ylabel="recompute TTFT / hit TTFT", title="speedup over recompute (crossover where it crosses 1)")
    if quantized:
        ts.plot_vs_exact(axes[0][2], record)
    for a in axes[0]:
        a.set_xscale("log", base=2)
        a.set_xticks(lengths, [str(n) for n in lengths])
        a.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        a.set_xlabel("cached prefix tokens")
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.suptitle(f"bench ttft (suffix {record['settings'].get('suffix')} tokens)")
    st = record["settings"]
    setup = (f"suffix {st['suffix']} tokens, chunk {st['chunk_size']}, engine prefix cache off for kvlayer; "
             f"hits with the chunks only in the measured tier (NVMe: page cache dropped; cpu+nvme: CPU emptied)")
    save_figure(fig, path, record, setup)
    close_figure(fig)
