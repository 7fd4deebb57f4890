"""``kvlayer bench ttft --verify``: what sampled hit verification costs (docs/architecture.md section 14).

Each kvlayer configuration runs twice in one run: as usual, and with ``verify_fraction`` 1.0
(label suffix ``verify``), where every hit is recomputed and, when its chunks would be saved,
compared with the copy the tier holds. Per prefix length this reports the verified hit's TTFT
against recompute's and against the same engine's first, all-miss request (compute and store:
the closest side-by-side figure, as verification is compute and compare), and
the mean TTFT at production rates: a share ``f`` of hits verified costs
``(1 - f) * hit + f * verified`` on average.
"""

from __future__ import annotations

from typing import Any

from kvlayer.benchmarks.common import print_table
from kvlayer.benchmarks.stats import ratio

SUFFIX = "verify"
RATES = (0.01, 0.05, 0.1)
"""The sampling rates whose mean TTFT is reported."""


def compare(variants: dict[str, dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per verified variant of ``build_record``'s ``variants`` and prefix length: its hit against
    the plain twin's and recompute's (``base``), the verification counters, and the mean TTFT
    at each of ``RATES``. [] when no variant ran with verification."""
    out = []
    for label, v in variants.items():
        if not v.get("verify_fraction"):
            continue
        twin = variants.get(label.removesuffix(f" {SUFFIX}"))
        for i, r in enumerate(v["by_length"]):
            b = base[r["prefix"]]
            hit = twin["by_length"][i]["hit_s"] if twin is not None else None
            row = {"config": label, "prefix": r["prefix"], "hit_s": hit, "verified_s": r["hit_s"],
                   "recompute_s": b["cold_s"], "verified_over_recompute": ratio(r["hit_s"], b["cold_s"]),
                   "miss_s": r["miss_s"], "verified_over_miss": ratio(r["hit_s"], r["miss_s"]),
                   "served_by": r["hit_tiers"],
                   "first_token_matches": r.get("first_token_matches")}
            for f in RATES:
                mean = (1 - f) * hit + f * r["hit_s"] if hit is not None else None
                row[f"mean_at_{f:g}_s"] = mean
                row[f"mean_at_{f:g}_over_hit"] = ratio(mean, hit)
            out.append(row)
    return out


def report(record: dict[str, Any]) -> None:
    """Print the verification table (nothing when ``--verify`` was not given)."""
    rows = record.get("verification") or []
    if not rows:
        return
    rates = [f"mean {100 * f:g}% s" for f in RATES]
    print_table("hit verification: every hit recomputed and compared (verify_fraction 1.0)",
                ["config", "prefix", "hit s", "verified s", "recompute s", "verified/recompute", "verified/miss",
                 *rates, f"mean {100 * RATES[-1]:g}%/hit"],
                [[r["config"], r["prefix"], r["hit_s"], r["verified_s"], r["recompute_s"],
                  r["verified_over_recompute"], r["verified_over_miss"], *(r[f"mean_at_{f:g}_s"] for f in RATES),
                  r[f"mean_at_{RATES[-1]:g}_over_hit"]] for r in rows])
    counts = {label: v["verified"] for label, v in record["variants"].items() if v.get("verify_fraction")}
    for label, c in counts.items():
        print(f"  {label}: verified_hits {c['verified_hits']}, verify_mismatches {c['verify_mismatches']}")
