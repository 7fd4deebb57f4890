"""Tier places tried before an engine starts (``kvlayer.places``, ``backends/probes.py``): an
unusable ``nvme_path`` or unreachable ``redis_url`` is one line in ``kvlayer config --check``
(exit 2; more cases in tests/test_config_check.py) and a tier left out, by name, in ``kvlayer
serve``'s start-up line, which lists the tiers in effect and their capacities."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from kvlayer import KVCacheEngine, KVLayout, places
from kvlayer.cli import main
from kvlayer.config import KVLayerConfig
from kvlayer.controller.client import AdminClient, ControllerError
from tests.controller.harness import ServerThread, wait_until
from tests.redis_server import RedisServer, free_port
from tests.serve_process import ServeProcess

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)
MIB = 1024**2


def under_a_file(tmp_path) -> str:
    """A folder path no one can make, root included: its parent is a regular file."""
    (tmp_path / "plain-file").write_text("x")
    return str(tmp_path / "plain-file" / "nvme")


def check(capsys, tmp_path, text: str) -> tuple[int, list[str], list[str]]:
    """``kvlayer config --check`` of a config file of ``text``: exit code, stdout and stderr lines."""
    path = tmp_path / "kvlayer.yaml"
    path.write_text(text)
    code = main(["config", "--check", "--file", str(path)])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err.splitlines()


def test_an_nvme_path_that_is_a_file_or_under_one_is_refused(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    code, out, err = check(capsys, tmp_path, f"cpu_capacity: 1MiB\nnvme_path: {tmp_path / 'a-file'}\n")
    assert (code, out, err) == (2, [], [f"kvlayer: error: nvme_path '{tmp_path / 'a-file'}' is not a folder"])

    # the section spelling is tried the same way
    bad = under_a_file(tmp_path)
    code, out, err = check(capsys, tmp_path, f"cpu_capacity: 1MiB\ntiers:\n  nvme:\n    path: {bad}\n")
    assert (code, out, err) == (2, [], [f"kvlayer: error: nvme_path '{bad}' is not usable: Not a directory"])


def test_every_problem_is_its_own_line_memory_first(tmp_path, capsys):
    bad = under_a_file(tmp_path)
    code, _, err = check(capsys, tmp_path, f"cpu_capacity: 200000GiB\nnvme_path: {bad}\n"
                                           f"redis_url: redis://127.0.0.1:{free_port()}\ntier_timeout_ms: 300\n")
    assert code == 2
    assert [line.split(":")[2].split()[0] for line in err] == ["cpu_capacity", "nvme_path", "redis_url"]


def test_without_turns_the_unusable_tiers_off_and_keeps_the_rest(tmp_path):
    bad = under_a_file(tmp_path)
    config = KVLayerConfig.from_dict({"cpu_capacity": "1MiB", "nvme_path": bad, "nvme_capacity": "5MiB",
                                      "redis_url": f"redis://127.0.0.1:{free_port()}", "tier_timeout_ms": 300})
    skipped = places.unusable(config)
    assert [(u.tier, u.setting) for u in skipped] == [("nvme", "nvme_path"), ("redis", "redis_url")]
    kept = places.without(config, skipped)
    assert (kept.nvme_path, kept.redis_url, kept.nvme_capacity, kept.cpu_capacity) == (None, None, 5 * MIB, MIB)
    assert not kept.tiers["nvme"].enabled and not kept.tiers["redis"].enabled
    assert places.unusable(kept) == [] and places.without(kept, []) is kept


def test_the_tiers_line_names_each_tier_in_effect_with_its_place_and_capacity(tmp_path):
    bad = under_a_file(tmp_path)
    with RedisServer(args=["--requirepass", "s3cret"]) as redis:
        url = f"redis://:s3cret@127.0.0.1:{redis.port}"
        config = KVLayerConfig.from_dict({"cpu_capacity": "1MiB", "staging_capacity": "1MiB", "chunk_size": 4,
                                          "nvme_path": bad, "redis_url": url})
        skipped = places.unusable(config)
        with KVCacheEngine(places.without(config, skipped).replace(nvme_path=str(tmp_path / "nvme"),
                                                                   nvme_capacity="2MiB"), LAYOUT) as kv:
            line = places.tiers_line(kv.backends, kv.config, skipped)
    assert line == (f"tiers cpu 1.0MiB, nvme {tmp_path / 'nvme'} 2.0MiB, redis redis://:***@127.0.0.1:{redis.port}; "
                    f"nvme_path '{bad}' is not usable: Not a directory (skipped)")
    assert "s3cret" not in line
    assert places.tiers_line([], config) == "no tiers"

    wrong = config.replace(redis_url=f"redis://:wrong@127.0.0.1:{free_port()}", nvme_path=None)
    reason, = [u.reason for u in places.unusable(wrong)]
    assert reason.startswith("redis_url: PING failed") and "wrong" not in reason


def test_serve_leaves_unusable_tiers_out_names_them_and_registers_its_served_name(tmp_path, tiny_model_dir):
    bad = under_a_file(tmp_path)
    redis_port = free_port()
    config = tmp_path / "kvlayer.yaml"
    with ServerThread() as controller, AdminClient(controller.address) as admin:
        config.write_text(f"cpu_capacity: 32MiB\nchunk_size: 16\nredis_url: redis://127.0.0.1:{redis_port}\n"
                          f"tier_timeout_ms: 300\ncontroller_url: {controller.address}\ninstance_id: served\n")
        # a place from a KVLAYER_* variable is left out too (the engine loads the variables again)
        with ServeProcess(tiny_model_dir, "--kv-config", str(config), "--kv-cache-memory", "64MiB",
                          "--served-model-name", "models/tiny",
                          env={"KVLAYER_TIERS": f"{{nvme: {{path: '{bad}'}}}}"}) as server:
            line, = [x for x in server.log().splitlines() if x.startswith("kvlayer serve:")]
            assert re.fullmatch(
                rf"kvlayer serve: 'models/tiny' at {re.escape(server.url)} \(kvlayer on: tiers cpu 32\.0MiB; "
                rf"nvme_path '{re.escape(bad)}' is not usable: Not a directory \(skipped\); "
                rf"redis_url: PING failed \(tier_timeout_ms 300\): .*127\.0\.0\.1:{redis_port}.* \(skipped\)\)", line)
            ids = list(range(3, 3 + 48))
            reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                               json={"model": "models/tiny", "prompt": ids, "max_tokens": 1, "temperature": 0})
            assert reply.status_code == 200, reply.text

            listed = wait_until(lambda: admin.list_instances().instances, what="registration")[0]
            assert (listed.instance_id, listed.served_model) == ("served", "models/tiny")
            assert [t.name for t in listed.tiers] == ["cpu"]
            found = wait_until(lambda: [m for m in admin.lookup(ids, "models/tiny").matches if m.cached_tokens],
                               what="the prompt's chunks in the registry")
            assert (found[0].instance_id, found[0].cached_tokens) == ("served", 48)
            assert admin.lookup(ids, listed.namespace.model_name).matches[0].cached_tokens == 48
            with pytest.raises(ControllerError) as e:
                admin.lookup(ids, "tiny-other")
            assert e.value.code == "NOT_FOUND"
