"""``kvlayer bench cache-server-mrqa`` at a tiny size, through ``kvlayer.cli.main``: a real cache
server and two real engine processes per configuration. The record's fields, hit rates and
TTFT that follow from the per-request rows, the sampled requests' exact tokens (with kvlayer
hits among them), the server's accounting (every lease back), and the bytes held: with room for
everything, the private tiers together hold exactly one more copy of the system prompt than the
shared server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlayer.benchmarks.common import default_model
from kvlayer.benchmarks.stats import summarize
from kvlayer.cli import main

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny preset: 2 layers x K and V x 2 heads x 16 dims x float32
USERS, ROUNDS, SYSTEM, HISTORY, CHUNK, SAMPLE = 4, 2, 128, 64, 32, 1


def test_shared_server_against_private_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "csm.json"
    model = default_model(str(tmp_path / "home"), "tiny")
    assert main(["bench", "cache-server-mrqa", "--model", model, "--home", str(tmp_path / "home"),
                 "--users", str(USERS), "--rounds", str(ROUNDS), "--system-tokens", str(SYSTEM),
                 "--history-tokens", str(HISTORY), "--question-tokens", "8", "--answer-tokens", "4",
                 "--chunk-size", str(CHUNK), "--sample", str(SAMPLE), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert f"wrote {out}" in printed.splitlines() and "shared vs split: hit rate" in printed
    assert record["bench"] == "cache-server-mrqa" and record["settings"]["engines"] == 2
    assert set(record["results"]) == {"shared", "split", "shared-roomy", "split-roomy"}
    capacity = record["capacity_bytes"]
    assert 0 < capacity < record["working_set_bytes"]["shared"] < record["working_set_bytes"]["split"]

    for label, r in record["results"].items():
        rows = [row for e in r["engines"] for row in e["requests"]]
        assert r["requests"] == len(rows) == USERS * (ROUNDS - 1)
        assert [e["users"] for e in r["engines"]] == [[0, 2], [1, 3]]  # user i on engine i % 2
        assert all(row["user"] % 2 == e["index"] for e in r["engines"] for row in e["requests"])
        assert r["prompt_tokens"] == sum(row["prompt"] for row in rows)
        assert r["hit_rate"] == pytest.approx(sum(row["external"] for row in rows) / r["prompt_tokens"])
        assert r["engine_hit_rate"] == 0  # the engines' prefix cache is off: every hit is kvlayer's
        assert r["ttft_s"] == pytest.approx(summarize([row["ttft_s"] for row in rows]))
        if label.startswith("shared"):
            assert r["kv"]["cpu_capacity"] == 0 and r["bytes_held"] == r["server"]["used_bytes"]
            assert r["server"]["leases"] == 0 and r["server"]["reserved"] == 0
            assert r["server"]["used_bytes"] <= r["server"]["capacity_bytes"]
            assert all(list(e["tiers"]) == ["cache"] for e in r["engines"])
        else:
            assert r["server"] is None and all(list(e["tiers"]) == ["cpu"] for e in r["engines"])
            assert r["bytes_held"] == sum(e["tiers"]["cpu"]["used_bytes"] for e in r["engines"])
            assert all(e["tiers"]["cpu"]["capacity_bytes"] <= r["kv"]["cpu_capacity"] for e in r["engines"])
    assert record["results"]["split"]["kv"]["cpu_capacity"] == capacity // 2
    assert record["results"]["shared"]["server"]["capacity_bytes"] == capacity

    roomy = {k: record["results"][f"{k}-roomy"] for k in ("shared", "split")}
    for r in roomy.values():  # nothing evicted: every user's history comes back from kvlayer
        assert r["kvlayer_tokens"] > 0
    held = record["comparison"]["roomy_bytes_held"]
    assert held["shared"] == roomy["shared"]["bytes_held"] < held["split"] == roomy["split"]["bytes_held"]
    assert held["duplicated"] == record["system_prompt_bytes"] == SYSTEM * TINY_BYTES_PER_TOKEN

    exact = record["exact"]
    assert exact["all_equal"] and len(exact["requests"]) == 4 * 2 * SAMPLE
    assert any(c["kvlayer_tokens"] > 0 for c in exact["requests"])  # hits among the checked requests
    c = record["comparison"]
    assert c["sharing_wins"] == (c["hit_rate_shared"] > c["hit_rate_split"]
                                 and record["results"]["shared"]["ttft_s"]["mean"]
                                 < record["results"]["split"]["ttft_s"]["mean"])
