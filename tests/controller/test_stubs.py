"""The committed gRPC stubs are what scripts/gen_proto.sh makes of the .proto today, and the
versions they demand at import are within pyproject.toml's floors.

The generator stamps its own version into the stubs (the protobuf runtime it requires,
``GRPC_GENERATED_VERSION``): a newer grpcio-tools changes those lines and nothing else, so
they are compared apart from the rest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("controller_pb2.py", "controller_pb2_grpc.py")
_STAMPS = re.compile(r"^# Protobuf Python Version: .*$|^GRPC_GENERATED_VERSION = .*$"
                     r"|ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*\d+,\s*\d+,\s*\d+,",
                     re.MULTILINE)


def unstamped(text: str) -> str:
    return _STAMPS.sub("<version>", text)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def floor(requirement: str) -> tuple[int, ...]:
    found = re.search(rf'"{re.escape(requirement)}>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, f"pyproject.toml names no floor for {requirement}"
    return version(found.group(1))


def test_generated_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True, timeout=120)
    for name in STUBS:
        fresh = unstamped((tmp_path / name).read_text())
        assert fresh == unstamped((ROOT / "controller" / name).read_text()), (
            f"controller/{name} is stale: run scripts/gen_proto.sh and commit the result")


def test_the_versions_the_stubs_demand_are_within_the_dependency_floors():
    grpc_stub = (ROOT / "controller" / "controller_pb2_grpc.py").read_text()
    grpc_needed = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", grpc_stub, re.MULTILINE)
    pb_needed = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                          (ROOT / "controller" / "controller_pb2.py").read_text())
    assert grpc_needed and pb_needed
    assert version(grpc_needed.group(1)) <= floor("grpcio"), "the stubs refuse the oldest grpcio pyproject allows"
    assert tuple(int(g) for g in pb_needed.groups()) <= floor("protobuf"), "and the oldest protobuf"


def test_stubs_load_under_their_full_proto_name():
    from kvlayer.controller import controller_pb2 as pb

    assert pb.DESCRIPTOR.name == "kvlayer/v1/controller.proto"
    assert pb.DESCRIPTOR.package == "kvlayer.v1"
    assert {s.name for s in pb.DESCRIPTOR.services_by_name.values()} == {"InstanceService", "AdminService"}
