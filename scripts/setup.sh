#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch 2.13.0 and kvlayer installed
# in editable mode. Re-running is fast: pip runs again only when pyproject.toml changes.
# Usage: scripts/setup.sh [test]   ("test" also installs the test extras and redis-server)
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-main}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.kvlayer-$want-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
    if [ "$want" = test ]; then extra=".[test,triton]"; else extra="."; fi
    .venv/bin/python -m pip install -q -e "$extra"
    touch "$stamp"
fi
if [ "$want" = test ] && ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo"
        $sudo_ apt-get update -qq >/dev/null && $sudo_ apt-get install -y -qq redis-server >/dev/null
    else
        echo "setup: redis-server not found; the Redis tests will be skipped" >&2
    fi
fi
