#!/usr/bin/env bash
# Runs the main job on the embedded default: a random-weight model (made once under
# .kvlayer/models), a multi-turn chat workload through the engine, per-turn TTFT and tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh main
exec .venv/bin/kvlayer demo "$@"
