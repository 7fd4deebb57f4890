"""Who may talk to the controller: bearer tokens, TLS, and bounded requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller import controller_pb2_grpc as pb_grpc
from kvlayer.controller.auth import authorized, read_token
from kvlayer.controller.client import AdminClient, ControllerError
from kvlayer.controller.settings import ControllerSettings
from tests.controller.fleet import ROOT, ControllerProcess
from tests.controller.harness import MODEL, ServerThread, connect, make_kv, store_tokens, wait_until
from tests.controller.tls_files import make_certificates

ADMIN, INSTANCE = "admin-secret-1", "instance-secret-2"


def code_of(call) -> str:
    with pytest.raises(ControllerError) as e:
        call()
    return e.value.code


def test_admin_calls_need_the_admin_token():
    with ServerThread(admin_token=ADMIN) as srv:
        for token in (None, "wrong", ADMIN + "x", INSTANCE):
            with AdminClient(srv.address, token=token) as admin:
                assert code_of(admin.list_instances) == "UNAUTHENTICATED"
                assert code_of(lambda a=admin: a.lookup([1, 2, 3], MODEL)) == "UNAUTHENTICATED"
                assert code_of(lambda a=admin: a.evict(all=True)) == "UNAUTHENTICATED"
                assert admin.health() == "SERVING", "the health service stays open"
        with AdminClient(srv.address, token=ADMIN) as admin:
            assert list(admin.list_instances().instances) == []


def test_instances_need_the_instance_token(caplog):
    with ServerThread(admin_token=ADMIN, instance_token=INSTANCE) as srv, \
            AdminClient(srv.address, token=ADMIN) as admin:
        kv = make_kv("a")
        denied = connect(kv, srv.address, token=ADMIN)
        try:
            with grpc.insecure_channel(srv.address) as channel:  # no token: refused before anything is read
                call = pb_grpc.InstanceServiceStub(channel).Connect(iter([pb.InstanceMessage()]))
                with pytest.raises(grpc.RpcError) as e:
                    next(call)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The first refusal can surface as INTERNAL when the abort races the agent's hello.
            wait_until(lambda: (denied.last_error or "").startswith("UNAUTHENTICATED"),
                       what="the agent to be refused")
            assert "UNAUTHENTICATED" in caplog.text, "each new failure reason is logged"
            assert not denied.connected and list(admin.list_instances().instances) == []
        finally:
            denied.close()
        agent = connect(kv, srv.address, token=INSTANCE)
        try:
            wait_until(lambda: agent.connected, what="registration with the right token")
            assert [i.instance_id for i in admin.list_instances().instances] == ["a"]
        finally:
            agent.close()
            kv.close()


def test_token_checks():
    assert authorized([("authorization", "Bearer tok")], "tok")
    assert not authorized([("authorization", "Bearer tok"), ("authorization", "Bearer tok")], "tok")
    assert not authorized([("authorization", "bearer tok")], "tok")
    assert not authorized([], "tok") and not authorized(None, "tok")
    assert read_token(None, "X", env={"X": " abc \n"}) == "abc"
    assert read_token(None, "X", env={}) is None
    with pytest.raises(ValueError):
        read_token(None, "X", env={"X": "two words"})
    with pytest.raises(ValueError):
        ControllerSettings(admin_token="")


def test_tls_with_a_certificate_made_here(tmp_path):
    files = make_certificates(tmp_path)
    with ServerThread(tls_cert=str(files.cert), tls_key=str(files.key), admin_token=ADMIN) as srv:
        kv = make_kv("secure")
        store_tokens(kv, list(range(1, 9)))
        agent = connect(kv, f"grpcs://{srv.address}?ca={files.ca_cert}")
        try:
            with AdminClient(srv.address, token=ADMIN, tls_ca=str(files.ca_cert)) as admin:
                wait_until(lambda: agent.connected, what="a TLS registration")
                assert admin.lookup(list(range(1, 9)), MODEL).matches[0].cached_tokens == 8
            with AdminClient(srv.address, token=ADMIN, timeout=2) as plaintext:
                assert code_of(plaintext.list_instances) == "UNAVAILABLE"
            with AdminClient(f"grpcs://{srv.address}", token=ADMIN, timeout=2) as untrusted:  # system roots
                assert code_of(untrusted.list_instances) == "UNAVAILABLE"
        finally:
            agent.close()
            kv.close()


def test_request_sizes_are_bounded():
    with ServerThread(max_tokens=1000, max_message_bytes=1024 * 1024) as srv, AdminClient(srv.address) as admin:
        kv = make_kv("a")
        agent = connect(kv, srv.address)
        try:
            wait_until(lambda: agent.connected, what="registration")
            assert code_of(lambda: admin.lookup(list(range(1001)), MODEL)) == "RESOURCE_EXHAUSTED"
            assert code_of(lambda: admin.pin("a", list(range(1001)))) == "RESOURCE_EXHAUSTED"
            assert code_of(lambda: admin.lookup(text="x" * 20_000, model=MODEL)) == "RESOURCE_EXHAUSTED"
            too_big = [1] * 1_100_000  # a byte each on the wire: past the 1 MiB message limit
            assert code_of(lambda: admin.lookup(too_big, MODEL)) == "RESOURCE_EXHAUSTED"
            assert admin.lookup(list(range(1000)), MODEL).num_tokens == 1000
        finally:
            agent.close()
            kv.close()


def test_client_certificates_when_the_controller_asks_for_them(tmp_path):
    files = make_certificates(tmp_path)
    with ServerThread(tls_cert=str(files.cert), tls_key=str(files.key), tls_client_ca=str(files.ca_cert)) as srv:
        # The test CA signed one certificate; it serves as the client's as well.
        mutual = f"grpcs://{srv.address}?ca={files.ca_cert}&cert={files.cert}&key={files.key}"
        with AdminClient(mutual) as admin:
            assert list(admin.list_instances().instances) == []
        with AdminClient(srv.address, tls_ca=str(files.ca_cert), timeout=2) as anonymous:
            assert code_of(anonymous.list_instances) == "UNAVAILABLE"


def test_the_controller_process_with_tls_flags_and_its_token_from_the_environment(tmp_path):
    files = make_certificates(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYER_")}
    tls = ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-client-ca", str(files.ca_cert)]
    (tmp_path / "admin.token").write_text(ADMIN + "\n")
    with ControllerProcess(tmp_path, tls, env={**env, "KVLAYER_ADMIN_TOKEN": ADMIN}) as controller:
        mutual = f"grpcs://{controller.address}?cert={files.cert}&key={files.key}"  # the CA signed one certificate
        cli = subprocess.run([sys.executable, "-m", "kvlayer.cli", "admin", "--controller", mutual, "--tls-ca",
                              str(files.ca_cert), "--token-file", str(tmp_path / "admin.token"), "--json", "instances"],
                             capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert cli.returncode == 0, f"{cli.stderr}\n{controller.tail()}"
        assert json.loads(cli.stdout) == {"instances": []}
        with AdminClient(mutual, tls_ca=str(files.ca_cert), timeout=5) as tokenless:
            assert code_of(tokenless.list_instances) == "UNAUTHENTICATED", "the token came from the environment"
        with AdminClient(controller.address, token=ADMIN, tls_ca=str(files.ca_cert), timeout=5) as certless:
            assert code_of(certless.list_instances) == "UNAVAILABLE", "--tls-client-ca asks for a certificate"
        with AdminClient(controller.address, token=ADMIN, timeout=5) as plaintext:
            assert code_of(plaintext.list_instances) == "UNAVAILABLE"
