"""The Redis tier under the bundled engine: exact tokens from Redis alone, from every tier
together, across processes, and through a Redis killed and restarted mid-workload.

Every test compares the output tokens with a run without kvlayer and checks that every
request finished normally. Run: ``.venv/bin/python -m pytest tests/connectors/test_redis_end_to_end.py``
(skips without redis-server). Fault injection at engine level is in ``test_tier_faults_end_to_end.py``,
which reuses the helpers defined here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync

from kvlayer import serde
from kvlayer.backends.redis_pairs import ChunkNames
from kvlayer.engine import LLM
from kvlayer.engine.outputs import RequestOutput
from tests.backends.test_redis import chunk_bytes
from tests.connectors.test_kvlayer_connector import GREEDY, C, conversation, make, run_chat
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

TURNS = 6
ROOT = str(Path(__file__).parents[2])
RESUME_WITHIN_S = 30.0
"""How long a test waits for a recovered tier to serve hits again: its backoff (1 s, doubling
per failed probe, see ``kvlayer.health``) with room to spare on a busy machine."""


# --- helpers (also used by test_tier_faults_end_to_end.py) --------------------------------
@pytest.fixture(scope="module")
def baseline(tiny_model_dir: str) -> list[tuple[int, ...]]:
    """Output tokens of each turn of ``conversation(TURNS)`` without kvlayer."""
    with make(tiny_model_dir) as llm:
        return [o.outputs[0].token_ids for o in run_chat(llm, conversation(TURNS))]


def flush(llm: LLM) -> None:
    """Wait for kvlayer's background writes and promotions."""
    assert llm.engine.connector.kv.tiers.flush(30.0), "background writes did not finish"


def ask(llm: LLM, prompt: Sequence[int]) -> RequestOutput:
    """One greedy request; it must finish normally (no failed request)."""
    out = llm.generate([{"prompt_token_ids": list(prompt)}], GREEDY)[0]
    assert out.finished and out.outputs[0].finish_reason == "length", out
    return out


def chat(llm: LLM, turns: int = TURNS, before: Callable[[int], None] | None = None) -> list[RequestOutput]:
    """``run_chat`` over ``conversation(turns)``, calling ``before(i)`` ahead of turn i."""
    history: list[int] = []
    outs = []
    for i, msg in enumerate(conversation(turns)):
        if before is not None:
            before(i)
        prompt = history + msg
        outs.append(ask(llm, prompt))
        history = prompt + list(outs[-1].outputs[0].token_ids)
    return outs


def tokens(outs: Sequence[RequestOutput]) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outs]


def external(outs: Sequence[RequestOutput]) -> list[int]:
    return [o.num_external_tokens for o in outs]


def served(outs: Sequence[RequestOutput]) -> int:
    """Tokens of the chunks kvlayer served: whole chunks, though the engine recomputes a
    prompt's last token (a fully cached prompt is served one token more than it uses)."""
    return sum(-(-o.num_external_tokens // C) * C for o in outs)


def tier(llm: LLM, name: str) -> dict[str, Any]:
    return llm.kv_stats()["tiers"][name]


def staging_used(llm: LLM) -> int:
    return llm.engine.connector.kv.staging.used_count


def redis_chunks(url: str, prefix: str = "kvlayer") -> dict[bytes, bytes | None]:
    """Every chunk under ``prefix`` by the name of its head, read with a plain client: its
    bytes (header, payload) joined from its two keys, or None when one of them is missing."""
    client = redis_sync.Redis.from_url(url, socket_timeout=5)
    try:
        names = sorted(client.scan_iter(match=f"{prefix}:{{*}}", count=1000))
        return {n: chunk_bytes(client, ChunkNames(n, n + b":b")) for n in names}
    finally:
        client.close()


def valid_chunk(name: bytes, value: bytes | None) -> bool:
    """Whether ``value`` is a whole chunk whose header names the key in the head's ``name``."""
    try:
        header = serde.decode_header(value or b"")
    except serde.ChunkFormatError:
        return False
    payload = value[serde.HEADER_SIZE:] if value else b""
    return (name.endswith(b":{" + header.key.hex().encode() + b"}") and len(payload) == header.payload_len
            and serde.payload_checksum(payload) == header.payload_checksum)


def redis_config(url: str, **extra: Any) -> dict[str, Any]:
    return {"chunk_size": C, "cpu_capacity": 0, "redis_url": url, **extra}


# --- tests --------------------------------------------------------------------------------
def test_redis_only(tiny_model_dir: str, baseline: list, redis_server: RedisServer) -> None:
    with make(tiny_model_dir, redis_config(redis_server.url)) as llm:
        outs = chat(llm, before=lambda i: flush(llm))  # writes to Redis are in the background
        assert tokens(outs) == baseline
        assert external(outs) == [0] + [len(o.prompt_token_ids) // C * C for o in outs[:-1]]
        stats = tier(llm, "redis")
        assert stats["hit_tokens"] == sum(external(outs)) > 0
        assert stats["errors"] == stats["timeouts"] == stats["checksum_errors"] == 0
        flush(llm)  # the last turn's writes, then the count of every chunk written
        chunks, put = redis_chunks(redis_server.url), tier(llm, "redis")["put_chunks"]
        assert len(chunks) == put > 0, "one head per chunk written"
        assert redis_sync.Redis.from_url(redis_server.url).dbsize() == 2 * len(chunks), "and one body"
        assert all(valid_chunk(n, v) for n, v in chunks.items()), "each pair is a whole chunk for its key"
        assert staging_used(llm) == 0


def test_redis_cluster_only(tiny_model_dir: str, baseline: list, redis_cluster: Any) -> None:
    with make(tiny_model_dir, redis_config(redis_cluster.url, redis_cluster=True)) as llm:
        outs = chat(llm, turns=3, before=lambda i: flush(llm))
        assert tokens(outs) == baseline[:3]
        assert tier(llm, "redis")["hit_tokens"] == sum(external(outs)) > 0
        assert tier(llm, "redis")["backend"]["node_errors"] == 0


def test_all_tiers_hits_come_from_the_top_tier_holding_them(tiny_model_dir: str, baseline: list,
                                                           redis_server: RedisServer, tmp_path: Path) -> None:
    kv = {"chunk_size": C, "cpu_capacity": "4MiB", "nvme_path": str(tmp_path / "a"), "redis_url": redis_server.url}
    with make(tiny_model_dir, kv) as llm:
        outs = chat(llm)
        assert tokens(outs) == baseline
        flush(llm)
        cpu, nvme, redis = (tier(llm, t) for t in ("cpu", "nvme", "redis"))
        assert cpu["hit_tokens"] == sum(external(outs)) > 0
        assert nvme["hit_tokens"] == redis["hit_tokens"] == 0
        written = cpu["put_chunks"]
        assert nvme["put_chunks"] == redis["put_chunks"] == written, "every stored chunk is written through"
        assert len(list((tmp_path / "a").rglob("*.kvc"))) == len(redis_chunks(redis_server.url)) == written

    # A new engine on the same disk folder: its CPU tier is empty, so hits come from NVMe
    # (above Redis) and are promoted into the CPU tier.
    with make(tiny_model_dir, kv) as llm:
        outs = chat(llm)
        assert tokens(outs) == baseline
        assert outs[0].num_external_tokens > 0, "the first turn hits chunks of the earlier engine"
        flush(llm)
        cpu, nvme, redis = (tier(llm, t) for t in ("cpu", "nvme", "redis"))
        assert nvme["hit_tokens"] > 0 and redis["hit_tokens"] == 0
        assert cpu["hit_tokens"] + nvme["hit_tokens"] == served(outs)
        assert cpu["promotions"] > 0 and nvme["promotions"] == 0

    # And on an empty disk folder: only Redis holds the chunks; they are promoted into both tiers above.
    with make(tiny_model_dir, {**kv, "nvme_path": str(tmp_path / "b")}) as llm:
        outs = chat(llm)
        assert tokens(outs) == baseline
        flush(llm)
        cpu, nvme, redis = (tier(llm, t) for t in ("cpu", "nvme", "redis"))
        assert redis["hit_tokens"] > 0 and nvme["hit_tokens"] == 0
        assert cpu["hit_tokens"] + redis["hit_tokens"] == served(outs)
        assert cpu["promotions"] > 0 and nvme["promotions"] > 0
        assert list((tmp_path / "b").rglob("*.kvc")), "chunks promoted from Redis land on disk"
        assert staging_used(llm) == 0


CHILD = textwrap.dedent("""
    import json, sys
    from tests.connectors.test_redis_end_to_end import chat, external, make, redis_config, tokens
    with make(sys.argv[1], redis_config(sys.argv[2])) as llm:
        outs = chat(llm, turns=3)
    print(json.dumps({"tokens": tokens(outs), "external": external(outs)}))
""")


def test_a_second_process_hits_what_the_first_stored(tiny_model_dir: str, baseline: list,
                                                      redis_server: RedisServer) -> None:
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", CHILD, tiny_model_dir, redis_server.url], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert [tuple(t) for t in first["tokens"]] == baseline[:3] == [tuple(t) for t in second["tokens"]]
    assert first["external"][0] == 0
    assert second["external"][0] > 0, "the second process hits what the first stored"
    assert sum(second["external"]) > sum(first["external"])


def until_hits_resume(llm: LLM, prompt: Sequence[int], expected: tuple[int, ...]) -> RequestOutput:
    """Ask ``prompt`` again and again until kvlayer serves part of it (its earlier runs store
    it), checking every answer; the output that hit. Fails after ``RESUME_WITHIN_S``."""
    deadline = time.monotonic() + RESUME_WITHIN_S
    while time.monotonic() < deadline:
        out = ask(llm, prompt)
        assert out.outputs[0].token_ids == expected
        if out.num_external_tokens > 0:
            return out
        flush(llm)
        time.sleep(0.05)  # poll interval while the tier's backoff runs out
    raise AssertionError(f"no hit within {RESUME_WITHIN_S} s: {tier(llm, 'redis')}")


def chat_through_outage(llm: LLM, baseline: list, down: Callable[[], None], up: Callable[[], None],
                        while_down: Callable[[], None]) -> list[RequestOutput]:
    """Turns 0-1, ``down()``, turns 2-3, ``while_down()``, ``up()``, turn 4 asked until kvlayer
    serves part of it (``until_hits_resume``), turn 5; every answer checked against ``baseline``.
    Returns the outputs of the six turns (turn 4's try that hit)."""
    msgs = conversation(TURNS)
    history: list[int] = []
    outs: list[RequestOutput] = []
    for i in range(TURNS):
        if i == 2:
            down()
        if i == 4:
            while_down()
            up()
        flush(llm)
        prompt = history + msgs[i]
        outs.append(until_hits_resume(llm, prompt, baseline[i]) if i == 4 else ask(llm, prompt))
        assert outs[-1].outputs[0].token_ids == baseline[i]
        history = prompt + list(outs[-1].outputs[0].token_ids)
    return outs


def test_redis_killed_mid_workload_and_restarted(tiny_model_dir: str, baseline: list, redis_server: RedisServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis dies inside a request, between the lookup that found its chunks and their load;
    the engine recomputes them, later lookups miss, and hits come back after a restart."""
    kv = redis_config(redis_server.url, tier_timeout_ms=300, unhealthy_after=2)
    killed: list[int] = []

    def kill_at_the_next_load() -> None:
        backend = next(b for b in llm.engine.connector.kv.backends if b.name == "redis")
        load = backend.read_layers

        async def dying(keys: Sequence[Any], *args: Any) -> Any:
            if not killed:  # once: the restarted server must live
                killed.append(len(keys))
                redis_server.kill()
            return await load(keys, *args)

        monkeypatch.setattr(backend, "read_layers", dying)

    def while_down() -> None:
        assert killed and killed[0] > 0, "turn 2's lookup found chunks, and Redis died before their load"
        dead = tier(llm, "redis")
        assert dead["errors"] + dead["timeouts"] > 0
        assert dead["health"]["healthy"] is False, "a tier failing again and again is marked unhealthy"

    with make(tiny_model_dir, kv) as llm:
        # Restarted empty, on the same port; the engine is not restarted.
        outs = chat_through_outage(llm, baseline, kill_at_the_next_load, redis_server.restart, while_down)
        assert outs[1].num_external_tokens > 0
        assert external(outs)[2:4] == [0, 0], "the failed load was recomputed; then lookups fail"
        assert outs[4].num_external_tokens > 0 and outs[5].num_external_tokens > 0
        stats = tier(llm, "redis")
        assert stats["health"]["healthy"] is True
        assert stats["hit_tokens"] == served(outs), "nothing of turn 2 was served"
        flush(llm)
        assert staging_used(llm) == 0
