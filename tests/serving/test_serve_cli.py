"""``kvlayer serve``'s command line: every bad argument is one line on stderr and exit 2, before the model loads."""

from __future__ import annotations

import socket

import pytest

from kvlayer.cli import main
from kvlayer.serving.listener import base_url, read_api_keys


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_flags(capsys, tiny_model_dir):
    assert "a port is 0..65535, got 99999" in one_line_error(capsys, ["serve", "--model", tiny_model_dir,
                                                                       "--port", "99999"])
    assert "must be positive, got 0" in one_line_error(capsys, ["serve", "--model", tiny_model_dir,
                                                                 "--max-waiting", "0"])
    assert "does not exist or is not a directory" in one_line_error(capsys, ["serve", "--model", "/no/such/model",
                                                                              "--port", "0"])


def test_a_port_in_use_is_refused_at_once(capsys, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = one_line_error(capsys, ["serve", "--model", tiny_model_dir, "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_api_key_files(tmp_path, capsys, tiny_model_dir):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\n  sk-a  \nsk-b\n", encoding="utf-8")
    assert read_api_keys(str(keys)) == ["sk-a", "sk-b"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n", encoding="utf-8")
    assert "no key in the file" in one_line_error(capsys, ["serve", "--model", tiny_model_dir,
                                                            "--api-key-file", str(empty)])
    assert "cannot read it: No such file" in one_line_error(capsys, ["serve", "--model", tiny_model_dir,
                                                                      "--api-key-file", str(tmp_path / "none")])


def test_a_bad_kvlayer_setting_names_the_key(capsys, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KVLAYER_CPU_CAPACITY", "12XB")
    assert "cpu_capacity" in one_line_error(capsys, ["serve", "--model", tiny_model_dir, "--port", "0"])


@pytest.mark.parametrize(("host", "port", "url"), [("127.0.0.1", 8000, "http://127.0.0.1:8000"),
                                                   ("::1", 9, "http://[::1]:9")])
def test_base_url(host, port, url):
    assert base_url(host, port) == url
    assert base_url("0.0.0.0", 80).startswith(f"http://{socket.getfqdn()}")
