"""``kvlayer admin``: tables for people, ``--json`` for scripts, one-line errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvlayer.cli import build_parser, main
from kvlayer.controller.client import AdminClient
from kvlayer.controller.settings import DEFAULT_LISTEN, ControllerSettings, parse_listen
from tests.controller.fleet import ROOT
from tests.controller.harness import MODEL, ServerThread, connect, make_kv, store_tokens, wait_until

TOKEN = "cli-admin-token"
TOKENS = list(range(1, 18))


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    with ServerThread(admin_token=TOKEN) as srv:
        engine = make_kv("engine-0", nvme_path=str(folder / "nvme"), instance_role="prefill")
        store_tokens(engine, TOKENS)
        agent = connect(engine, srv.address)
        try:
            wait_until(lambda: agent.connected, what="registration")
            (folder / "token").write_text(TOKEN)
            yield srv, str(folder / "token")
        finally:
            agent.close()
            engine.close()


def admin(controller, capsys, *args: str) -> tuple[int, str, str]:
    srv, token_file = controller
    code = main(["admin", "--controller", srv.address, "--token-file", token_file, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_answers_are_the_rpc_answers(controller, capsys):
    tokens = ",".join(map(str, TOKENS))
    code, out, _ = admin(controller, capsys, "--json", "lookup", "--model", MODEL, "--tokens", tokens)
    assert code == 0
    answer = json.loads(out)
    assert answer["num_tokens"] == 17
    assert [(m["instance_id"], m["cached_tokens"]) for m in answer["matches"]] == [("engine-0", 16)]
    assert {t["tier"]: t["prefix_tokens"] for t in answer["matches"][0]["tiers"]} == {"cpu": 16, "nvme": 16}
    code, out, _ = admin(controller, capsys, "instances", "--json")  # --json after the command works too
    listed = json.loads(out)["instances"][0]
    assert code == 0 and (listed["state"], listed["role"]) == ("INSTANCE_STATE_UP", "prefill")
    assert answer["matches"][0]["role"] == "prefill"


def test_tables_and_commands(controller, capsys):
    tokens = " ".join(map(str, TOKENS))
    code, out, _ = admin(controller, capsys, "instances")
    assert code == 0 and "engine-0" in out and "up" in out and "prefill" in out and "cpu, nvme" in out
    assert out.index("role") < out.index("model"), "the role column, after the state"
    code, out, _ = admin(controller, capsys, "pin", "--instance", "engine-0", "--tokens", tokens, "--tier", "cpu")
    assert code == 0 and "engine-0" in out and "yes" in out
    code, out, _ = admin(controller, capsys, "unpin", "--instance", "engine-0", "--tokens", tokens)
    assert code == 0
    code, out, _ = admin(controller, capsys, "move", "--instance", "engine-0", "--src-tier", "cpu", "--dst-tier",
                         "nvme", "--tokens", tokens)
    assert code == 0
    code, out, _ = admin(controller, capsys, "lookup", "--model", MODEL, "--tokens", tokens)
    assert code == 0 and "16/17" in out and "cpu 0, nvme 16" in out
    code, out, _ = admin(controller, capsys, "stats", "--instance", "engine-0")
    assert code == 0 and "nvme" in out and "yes" in out
    code, out, _ = admin(controller, capsys, "evict", "--all")
    assert code == 0 and "engine-0" in out
    with AdminClient(controller[0].address, token=TOKEN) as client:
        assert client.lookup(TOKENS, MODEL).matches[0].cached_tokens == 0


def test_refusals_exit_non_zero_with_one_line(controller, capsys, tmp_path):
    code, out, err = admin(controller, capsys, "pin", "--instance", "nobody", "--tokens", "1,2,3")
    assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith("kvlayer admin: NOT_FOUND: ")
    code, _, err = admin(controller, capsys, "lookup", "--model", MODEL, "--tokens", "-1")
    assert code == 1 and err.startswith("kvlayer admin: INVALID_ARGUMENT: ")
    (tmp_path / "wrong").write_text("not-the-token")
    code = main(["admin", "--controller", controller[0].address, "--token-file", str(tmp_path / "wrong"), "instances"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("kvlayer admin: UNAUTHENTICATED: ")
    code = main(["admin", "--controller", controller[0].address, "lookup", "--model", MODEL, "--tokens", "a,b"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "token ids must be integers" in err


def test_an_unreadable_token_file_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for command in (["admin", "--controller", "127.0.0.1:1", "--token-file", str(folder), "instances"],
                    ["controller", "--listen", "127.0.0.1:0", "--admin-token-file", str(folder)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvlayer: error: ") and "Is a directory" in err
    secret = tmp_path / "secret.token"
    secret.write_text(TOKEN)

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("pathlib.Path.read_text", denied)  # root reads any file: chmod cannot deny it
    assert main(["admin", "--controller", "127.0.0.1:1", "--token-file", str(secret), "instances"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvlayer: error: [Errno 13] Permission denied: '{secret}'\n"


def test_the_entry_point_in_a_process(controller):
    srv, token_file = controller
    run = lambda *args, **kw: subprocess.run([sys.executable, "-m", "kvlayer.cli", "admin", "--controller", srv.address,
                                              *args], capture_output=True, text=True, cwd=ROOT, timeout=60, **kw)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    ok = run("--json", "instances", env={**env, "KVLAYER_ADMIN_TOKEN": TOKEN})  # the token from the environment
    assert ok.returncode == 0, ok.stderr
    assert [i["instance_id"] for i in json.loads(ok.stdout)["instances"]] == ["engine-0"]
    refused = run("instances", env=env)
    assert refused.returncode == 1 and refused.stderr.startswith("kvlayer admin: UNAUTHENTICATED")


def test_the_controller_binds_loopback_unless_told_otherwise():
    assert build_parser().parse_args(["controller"]).listen == DEFAULT_LISTEN == "127.0.0.1:50051"


@pytest.mark.parametrize(("listen", "says"), [
    ("127.0.0.1:99999", "port must be 0..65535"), ("127.0.0.1:65536", "port must be 0..65535"),
    ("127.0.0.1:-1", "port must be 0..65535"), ("127.0.0.1:http", "port must be 0..65535"),
    (":50051", "HOST:PORT"), ("127.0.0.1", "HOST:PORT"),
])
def test_a_bad_listen_address_is_one_line_and_exit_2(listen, says, capsys):
    assert main(["controller", "--listen", listen]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvlayer controller: error: argument --listen: ") and says in err
    with pytest.raises(ValueError, match=says):
        ControllerSettings(listen=listen)


def test_listen_addresses_parse_to_host_and_port():
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:65535") == ("::1", 65535)
    assert parse_listen("0.0.0.0:50051") == ("0.0.0.0", 50051)
