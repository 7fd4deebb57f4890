"""Tier faults under the bundled engine: corrupted Redis values, a frozen Redis, a full disk and
a read-only disk folder. Tokens stay identical to a run without kvlayer, every request
finishes, and each fault shows in its counter.

Run: ``.venv/bin/python -m pytest tests/connectors/test_tier_faults_end_to_end.py`` (the Redis
tests skip without redis-server; the read-only folder test needs a non-root user, or root
allowed to make a private read-only bind mount with ``unshare``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync

from kvlayer.backends import nvme_files
from kvlayer.backends.redis_pairs import ChunkNames
from tests.backends.test_redis import store_bytes
from tests.connectors.test_kvlayer_connector import C, make
from tests.connectors.test_redis_end_to_end import (
    ROOT,
    baseline,  # noqa: F401 - the module fixture
    chat,
    chat_through_outage,
    external,
    flush,
    redis_chunks,
    redis_config,
    served,
    staging_used,
    tier,
    tokens,
    valid_chunk,
)
from tests.redis_server import RedisServer

CLEAN_WITHIN_S = 10.0


def nvme_config(path: Path, **extra: Any) -> dict[str, Any]:
    return {"chunk_size": C, "cpu_capacity": 0, "nvme_path": str(path), **extra}


def chunk_files(root: Path) -> set[Path]:
    return set(root.rglob("*.kvc"))


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(nvme_files.TEMP_PREFIX)]


# --- Redis ----------------------------------------------------------------------------------
def corrupt_every_value(url: str) -> int:
    """Flip a bit in a third of the chunks (in the body, or every other time in the head's
    tail), truncate another third, give the rest another key's bytes (each chunk's bytes
    edited as a file's, then stored back as its two keys); returns how many were corrupted."""
    chunks = redis_chunks(url)
    names = list(chunks)
    client = redis_sync.Redis.from_url(url, socket_timeout=5)
    try:
        for i, name in enumerate(names):
            value = bytearray(chunks[name] or b"")
            if i % 3 == 0:
                value[len(value) // 2 if i % 2 else -1] ^= 0x10
            elif i % 3 == 1:
                del value[-100:]
            else:
                value = bytearray(chunks[names[(i + 1) % len(names)]] or b"")
            store_bytes(client, ChunkNames(name, name + b":b"), bytes(value))
    finally:
        client.close()
    return len(names)


def wait_until_clean(url: str) -> None:
    """Poll until Redis holds no invalid value (the tier deletes those it reads)."""
    deadline = time.monotonic() + CLEAN_WITHIN_S
    while any(not valid_chunk(n, v) for n, v in redis_chunks(url).items()):
        assert time.monotonic() < deadline, "corrupt values read by the tier were not deleted"
        time.sleep(0.02)


@pytest.mark.redis
def test_corrupted_redis_values_are_misses(tiny_model_dir: str, baseline: list,  # noqa: F811
                                           redis_server: RedisServer) -> None:
    """Every value corrupted while the engine runs: each read of one is a counted miss (the
    engine recomputes), the bad values are deleted, and later turns hit again."""
    url = redis_server.url

    def before(i: int) -> None:
        flush(llm)
        if i == 2:
            assert corrupt_every_value(url) >= 3
        if i == 3:
            wait_until_clean(url)

    with make(tiny_model_dir, redis_config(url)) as llm:
        outs = chat(llm, before=before)
        assert tokens(outs) == baseline
        stats = tier(llm, "redis")
        assert stats["backend"]["checksum_errors"] >= 3
        assert stats["checksum_errors"] == stats["backend"]["checksum_errors"], "mirrored into the metrics"
        assert outs[1].num_external_tokens > 0 and sum(external(outs[3:])) > 0, "hits resume after the fault"
        flush(llm)
        assert staging_used(llm) == 0


@pytest.mark.redis
def test_frozen_redis_costs_deadlines_not_a_hang(tiny_model_dir: str, baseline: list,  # noqa: F811
                                                 redis_server: RedisServer) -> None:
    """A server that stops answering (SIGSTOP) makes lookups time out within tier_timeout_ms;
    once it answers again, the chunks it held before are hits again."""
    kv = redis_config(redis_server.url, tier_timeout_ms=300, unhealthy_after=2)

    def while_down() -> None:
        assert tier(llm, "redis")["timeouts"] > 0

    with make(tiny_model_dir, kv) as llm:
        try:
            outs = chat_through_outage(llm, baseline, redis_server.pause, redis_server.resume, while_down)
        finally:
            redis_server.resume()
        assert external(outs)[2:4] == [0, 0]
        slowest = max(o.metrics.finish_time - o.metrics.arrival_time for o in outs[2:4])
        assert slowest < 5.0, "a frozen tier costs a request deadlines, not a hang"
        assert outs[4].num_external_tokens >= outs[1].num_external_tokens, "what Redis held before is hit again"
        flush(llm)
        assert staging_used(llm) == 0


# --- NVMe -------------------------------------------------------------------------------------
def _disk_full(fd: int, parts: Any) -> None:
    os.write(fd, parts[0][:100])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_midway(tiny_model_dir: str, baseline: list, tmp_path: Path,  # noqa: F811
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the second turn on: writes fail cleanly (counted, no temporary file left),
    the chunks already on disk keep serving hits, and writes resume once there is room."""
    written: list[set[Path]] = []

    def before(i: int) -> None:
        flush(llm)
        if i == 2:
            monkeypatch.setattr(nvme_files, "write_parts", _disk_full)
            written.append(chunk_files(tmp_path))
        if i == 4:
            assert chunk_files(tmp_path) == written[0], "no chunk file appears while the disk is full"
            monkeypatch.undo()

    with make(tiny_model_dir, nvme_config(tmp_path)) as llm:

        outs = chat(llm, before=before)
        assert tokens(outs) == baseline
        flush(llm)
        nvme = tier(llm, "nvme")
        assert nvme["backend"]["write_errors"] > 0
        assert nvme["health"]["healthy"], "a failed write is counted, not a tier failure"
        assert temp_files(tmp_path) == []
        ext = external(outs)
        assert ext[2] > 0, "chunks written before the disk filled up still hit"
        assert ext[5] > ext[3], "writes resume once there is room"
        assert nvme["hit_tokens"] == served(outs)


READ_ONLY_CHILD = textwrap.dedent("""
    import json, sys
    from tests.connectors.test_redis_end_to_end import chat, external, make, tier, tokens
    from tests.connectors.test_tier_faults_end_to_end import nvme_config
    with make(sys.argv[1], nvme_config(sys.argv[2])) as llm:
        outs = chat(llm)
        stats = tier(llm, "nvme")
    print(json.dumps({"tokens": tokens(outs), "external": external(outs), "nvme": stats["backend"],
                      "healthy": stats["health"]["healthy"]}))
""")


def read_only_command(folder: Path) -> list[str]:
    """How to run a Python child that sees ``folder`` read-only: a plain child for a non-root
    user (after ``chmod``), a private read-only bind mount for root (who ignores mode bits)."""
    child = [sys.executable, "-c", READ_ONLY_CHILD]
    if os.geteuid() != 0:
        for d in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
            d.chmod(0o555)
        return child
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("root ignores mode bits, and unshare (for a read-only bind mount) is missing")
    mount = f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" "{folder}"'
    probe = subprocess.run([unshare, "-m", "sh", "-c", mount], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private read-only bind mount: {probe.stderr.decode(errors='replace')}")
    return [unshare, "-m", "sh", "-c", f'{mount} && exec "$0" "$@"', *child]


def test_read_only_disk_folder(tiny_model_dir: str, baseline: list, tmp_path: Path) -> None:  # noqa: F811
    folder = tmp_path / "nvme"
    with make(tiny_model_dir, nvme_config(folder)) as llm:  # fill the folder with the first turns
        chat(llm, turns=2, before=lambda i: flush(llm))
    files = chunk_files(folder)
    assert files
    command = read_only_command(folder)
    try:
        out = subprocess.run([*command, tiny_model_dir, str(folder)], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    finally:
        for d in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
            d.chmod(0o755)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert [tuple(t) for t in run["tokens"]] == baseline
    assert run["external"][0] > 0 and run["external"][1] > 0, "the chunks already on disk are read"
    assert run["nvme"]["write_errors"] > 0 and run["nvme"]["puts"] == 0
    assert run["healthy"]
    assert chunk_files(folder) == files and temp_files(folder) == []


# --- layer-by-layer loads: corruption found after the first layers were used ------------------
def flip_last_layer_of_every_chunk(kind: str, where: str) -> int:
    """Flip a byte near the end (the last layer) of every stored chunk; returns how many."""
    if kind == "nvme":
        files = sorted(chunk_files(Path(where)))
        for path in files:
            data = bytearray(path.read_bytes())
            data[-5] ^= 0x08
            path.write_bytes(bytes(data))
        return len(files)
    chunks = redis_chunks(where)
    client = redis_sync.Redis.from_url(where, socket_timeout=5)
    try:
        for i, (name, value) in enumerate(chunks.items()):
            data = bytearray(value or b"")
            data[-5 if i % 2 else -200] ^= 0x08  # in the head's tail, or at the end of the body
            store_bytes(client, ChunkNames(name, name + b":b"), bytes(data))
    finally:
        client.close()
    return len(chunks)


@pytest.mark.parametrize("kind", ["nvme", pytest.param("redis", marks=pytest.mark.redis)])
def test_corruption_found_after_early_layers_were_used(tiny_model_dir: str, baseline: list,  # noqa: F811
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       request: pytest.FixtureRequest, kind: str) -> None:
    """Loads stream one layer at a time, so a chunk whose last layer is corrupt is only found
    bad after the step computed over its first layers: that step's work is discarded and
    recomputed, the tokens stay those of a run without kvlayer, and later turns hit again."""
    from kvlayer import cache_engine, read_plan

    monkeypatch.setattr(read_plan, "MIN_GROUP_BYTES", 1)  # one group per layer
    used: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(cache_engine, "layer_groups", lambda *a: used.append(read_plan.layer_groups(*a)) or used[-1])
    if kind == "nvme":
        where, config = str(tmp_path / "nvme"), nvme_config(tmp_path / "nvme")
    else:
        where = request.getfixturevalue("redis_server").url
        config = redis_config(where)

    def before(i: int) -> None:
        flush(llm)
        if i == 2:
            assert flip_last_layer_of_every_chunk(kind, where) >= 3

    with make(tiny_model_dir, config) as llm:
        outs = chat(llm, before=before)
        assert used and all(len(groups) >= 2 for groups in used), "loads streamed layer by layer"
        assert tokens(outs) == baseline
        assert tier(llm, kind)["checksum_errors"] >= 1
        assert outs[1].num_external_tokens > 0 and sum(external(outs[3:])) > 0, "hits resume after the fault"
        flush(llm)
        assert staging_used(llm) == 0
