"""``kvlayer config --check``: tries ``nvme_path`` (a probe file) and ``redis_url`` (a PING), written
flat or in their tier's section (``tiers: {nvme: {path: ...}}``).

Each problem is one line on stderr and the exit status is 2; places that work exit 0 and
leave nothing behind (the probe file and any folder the check made are removed).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvlayer.cli import main
from tests.redis_server import RedisServer


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, *more: str) -> tuple[int, str, str]:
    config = tmp_path / "kvlayer.yaml"
    config.write_text(text)
    code = main(["config", "--file", str(config), "--check", *more])
    out = capsys.readouterr()
    return code, out.out, out.err


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_kvlayer_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVLAYER_")]:
        monkeypatch.delenv(name)


def test_a_usable_folder_passes_and_is_left_as_found(tmp_path, capsys):
    folder = tmp_path / "new" / "kv"
    code, out, err = check(tmp_path, capsys, f"nvme_path: {folder}\n")
    assert (code, err) == (0, "") and out == "kvlayer config: nvme_path usable\n"
    assert not (tmp_path / "new").exists(), "the folders the check made are removed"
    folder.mkdir(parents=True)
    (folder / "chunk").write_bytes(b"x")
    assert check(tmp_path, capsys, f"nvme_path: {folder}\n")[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == ["chunk"], "only the probe file is removed"


@pytest.mark.parametrize("kind", ["file", "under-a-file", "proc"])
def test_an_unusable_folder_is_one_line_and_exit_2(kind, tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    path = {"file": tmp_path / "a-file", "under-a-file": tmp_path / "a-file" / "kv", "proc": "/proc/kvlayer/kv"}[kind]
    code, out, err = check(tmp_path, capsys, f"nvme_path: {path}\n")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"kvlayer: error: nvme_path {str(path)!r} is not ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder whatever its mode")
def test_a_read_only_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        code, _, err = check(tmp_path, capsys, f"nvme_path: {folder}\n")
    finally:
        folder.chmod(0o700)
    assert code == 2 and "Permission denied" in err


def test_an_unreachable_redis_is_one_line_within_the_tier_timeout(tmp_path, capsys):
    port = closed_port()
    code, out, err = check(tmp_path, capsys, f"redis_url: redis://127.0.0.1:{port}/0\ntier_timeout_ms: 500\n")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvlayer: error: redis_url: PING failed (tier_timeout_ms 500): ") and str(port) in err


def test_every_problem_is_its_own_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    code, _, err = check(tmp_path, capsys, f"nvme_path: {tmp_path / 'a-file'}\n"
                                           f"redis_url: redis://127.0.0.1:{closed_port()}\n", "--show")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2
    assert lines[0].startswith("kvlayer: error: nvme_path") and lines[1].startswith("kvlayer: error: redis_url")


def test_a_live_redis_answers(tmp_path, capsys):
    with RedisServer() as server:
        code, out, err = check(tmp_path, capsys, f"redis_url: {server.url}\nnvme_path: {tmp_path / 'kv'}\n",
                               "--show")
    assert (code, err) == (0, "")
    assert f"redis_url: {server.url}" in out and out.endswith("kvlayer config: nvme_path and redis_url usable\n")


def test_without_places_there_is_nothing_to_try(tmp_path, capsys):
    code, out, _ = check(tmp_path, capsys, "cpu_capacity: 1GiB\n")
    assert code == 0 and out == "kvlayer config: no nvme_path or redis_url to try\n"


def test_a_tiers_section_is_tried_as_its_flat_keys_are(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    code, out, err = check(tmp_path, capsys, f"tiers:\n  nvme:\n    path: {tmp_path / 'kv'}\n")
    assert (code, err) == (0, "") and out == "kvlayer config: nvme_path usable\n"
    code, _, err = check(tmp_path, capsys, f"tiers:\n  nvme:\n    path: {tmp_path / 'a-file'}\n")
    assert code == 2 and err.startswith("kvlayer: error: nvme_path ") and err.count("\n") == 1


def test_an_unknown_key_of_a_tier_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = check(tmp_path, capsys, "tiers:\n  redis:\n    uri: redis://127.0.0.1\n")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvlayer: error: unknown setting 'uri' of tier 'redis' (tiers.redis.uri)")
