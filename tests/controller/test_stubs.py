"""The committed gRPC stubs are what scripts/gen_proto.sh makes of the .proto today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("controller_pb2.py", "controller_pb2_grpc.py")


def test_generated_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True, timeout=120)
    for name in STUBS:
        fresh = (tmp_path / name).read_text()
        assert fresh == (ROOT / "controller" / name).read_text(), (
            f"controller/{name} is stale: run scripts/gen_proto.sh and commit the result")


def test_stubs_load_under_their_full_proto_name():
    from kvlayer.controller import controller_pb2 as pb

    assert pb.DESCRIPTOR.name == "kvlayer/v1/controller.proto"
    assert pb.DESCRIPTOR.package == "kvlayer.v1"
    assert {s.name for s in pb.DESCRIPTOR.services_by_name.values()} == {"InstanceService", "AdminService"}
