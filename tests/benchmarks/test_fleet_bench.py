"""``kvlayer bench fleet``: real fleets (a controller, two ``kvlayer serve`` instances of the tiny
model and a router, per policy) serving a small chat workload, checked through the JSON record;
its flag errors (one line, exit 2, no model made); and the pieces it adds: the instance header
in ``Completion`` and the parsing of the router's series.

The workload makes the hit-rate comparison deterministic: three users (odd, so round-robin over
two instances sends each user's next turn to the other instance), histories of several chunks,
every user returning, and CPU tiers that hold each instance's share of the users but not all of them.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from kvlayer.benchmarks.fleet_run import parse_series
from kvlayer.benchmarks.http_client import completion_body, stream_completion
from kvlayer.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
USERS, ROUNDS, WARMUP = 3, 3, 1
WORKLOAD = ["--users", str(USERS), "--rounds", str(ROUNDS), "--warmup-rounds", str(WARMUP), "--system-tokens", "32",
            "--history-tokens", "96", "--question-tokens", "8", "--answer-tokens", "4", "--chunk-size", "16",
            "--rate", "2"]


def _fleet_children() -> list[str]:
    """The command lines of this process's children that are kvlayer processes."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and "kvlayer.cli" in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.slow  # a fleet per policy; the docs test runs the documented command (KVLAYER_SMOKE) in CI
def test_kv_routing_caches_more_than_round_robin_and_every_request_is_served(tiny_model_dir, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.delenv("KVLAYER_SMOKE", raising=False)
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    code = main(["bench", "fleet", "--model", tiny_model_dir, "--home", str(tmp_path / "home"), "--instances", "2",
                 "--policies", "kv,round-robin", "--no-pd", *WORKLOAD, "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert png.read_bytes()[:8] == PNG
    assert not _fleet_children(), "every process the bench started is stopped"
    record = json.loads(out.read_text())
    assert record["bench"] == "fleet" and record["machine"]["cores"] >= 1 and record["pd_skipped"] == "--no-pd"
    assert [c["name"] for c in record["configs"]] == ["kv", "round-robin"]
    by = {r["label"]: r for r in record["results"]}
    measured = USERS * (ROUNDS - WARMUP)
    for name, r in by.items():
        assert (r["requests"], r["succeeded"], r["failed"]) == (measured, measured, 0), (name, r["failures"])
        assert r["warmup"]["succeeded"] == USERS * WARMUP
        assert set(r["instances"]) == {"a", "b"}
        assert sum(i["requests"] for i in r["instances"].values()) == measured
        assert sum(i["routed_total"] for i in r["instances"].values()) == measured + USERS * WARMUP
        assert r["ttft_s"]["mean"] > 0 and r["generated_tok_per_s"] > 0
        assert {row["instance"] for row in record["requests"][name]} <= {"a", "b"}
    assert by["kv"]["cached_share"] > by["round-robin"]["cached_share"], (by["kv"]["cached_share"],
                                                                          by["round-robin"]["cached_share"])
    goal = record["goals"]["kv_over_round_robin"]
    assert goal["mean_ttft"] > 0 and goal["gen_tok_s"] > 0 and isinstance(goal["met"], bool)
    assert record["goals"]["pd_over_colocated"]["mean_ttft"] is None
    assert "kv / round-robin: mean TTFT" in printed and ("met" in printed or "MISSED" in printed)
    assert record["sizes"]["cpu_tier_over_working_set"] < 1 <= record["sizes"]["working_set_over_engine_kv"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--instances", "1"], "argument --instances: must be within 2..8, got 1"),
    (["--instances", "9"], "argument --instances: must be within 2..8, got 9"),
    (["--policies", "kv,fastest"], "argument --policies: unknown policy 'fastest'"),
    (["--policies", "kv,,random"], "argument --policies: empty item in 'kv,,random'"),
    (["--policies", "kv,kv"], "argument --policies: a policy named twice"),
    (["--users", "0"], "argument --users: must be positive"),
    (["--rate", "0"], "argument --rate: must be positive"),
    (["--history-tokens", "-1"], "argument --history-tokens: must be >= 0"),
    (["--engine-kv-memory", "lots"], "argument --engine-kv-memory: not a size"),
    (["--cpu-capacity", "lots"], "argument --cpu-capacity: not a size"),
    (["--chunk-size", "0"], "argument --chunk-size: must be positive"),
    (["--redis-url", "http://x"], "argument --redis-url: expected a URL starting redis://"),
    (["--pd", "--no-such"], "unrecognized arguments: --no-such"),
    (["--rounds", "3", "--warmup-rounds", "3"], "--warmup-rounds must be below --rounds (3)"),
])
def test_a_bad_flag_is_one_line_and_starts_nothing(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVLAYER_SMOKE", raising=False)
    home = tmp_path / "home"
    assert main(["bench", "fleet", "--home", str(home), *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("kvlayer"), lines
    assert not home.exists(), "the flags are checked before a model is made"


def test_an_engine_kv_cache_below_the_largest_request_is_refused(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("KVLAYER_SMOKE", raising=False)
    assert main(["bench", "fleet", "--model", tiny_model_dir, "--engine-kv-memory", "1KiB", *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlayer: error: --engine-kv-memory 1KiB cannot hold the largest request"), err


def test_a_completion_carries_the_instance_header_when_there_is_one():
    stream = b'data: {"choices": [{"token_ids": [5]}]}\n\ndata: [DONE]\n\n'

    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"x-kvlayer-instance": "b"} if request.url.host == "routed" else {}
        return httpx.Response(200, content=stream, headers={**headers, "content-type": "text/event-stream"})

    async def one(host: str):
        async with httpx.AsyncClient(base_url=f"http://{host}", transport=httpx.MockTransport(answer)) as c:
            return await stream_completion(c, completion_body("m", [1, 2], 1))

    routed, direct = asyncio.run(one("routed")), asyncio.run(one("direct"))
    assert routed.ok and routed.instance == "b" and routed.token_ids == (5,)
    assert direct.ok and direct.instance is None


def test_the_routers_series_are_read_by_name_and_instance():
    page = ("# HELP kvlayer_router_requests_total Requests forwarded, by instance\n"
            'kvlayer_router_requests_total{instance="a"} 3.0\nkvlayer_router_requests_total{instance="b"} 4.0\n'
            "kvlayer_router_lookup_failures_total 1.0\nkvlayer_router_instance_load{instance=\"a\"} 2.0\n"
            "other_series 9.0\n")
    series = parse_series(page)
    assert series["kvlayer_router_requests_total"] == {"a": 3.0, "b": 4.0}
    assert series["kvlayer_router_lookup_failures_total"] == {"": 1.0}
    assert series["kvlayer_router_instance_load"] == {"a": 2.0} and "other_series" not in series
