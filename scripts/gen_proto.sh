#!/usr/bin/env bash
# Regenerates the controller's Python stubs from proto/kvlayer/v1/controller.proto.
#
#   scripts/gen_proto.sh [OUT_DIR]    (default: controller/)
#
# protoc writes kvlayer/v1/controller_pb2*.py; they are moved flat into OUT_DIR and the
# generated import is pointed at kvlayer.controller, where the package installs, and a
# "# ruff: noqa" line is put on top (generated code is not linted). The
# descriptor keeps its full name (kvlayer/v1/controller.proto), so it never clashes with
# another project's controller.proto in the same process.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-controller}"
python="${PYTHON:-.venv/bin/python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m grpc_tools.protoc -I proto --python_out="$tmp" --grpc_python_out="$tmp" \
    proto/kvlayer/v1/controller.proto
mkdir -p "$out"
for f in controller_pb2.py controller_pb2_grpc.py; do
    {
        echo "# ruff: noqa"
        sed -e 's/^from kvlayer\.v1 import controller_pb2 as/from kvlayer.controller import controller_pb2 as/' \
            "$tmp/kvlayer/v1/$f"
    } > "$out/$f"
done
