#!/usr/bin/env bash
# Runs the whole CI test suite (slow tests excluded; add "-m slow" to run only those).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
