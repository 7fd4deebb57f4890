#!/usr/bin/env bash
# The main job: `kvlayer bench multi-round-qa` at a small scale on the embedded default, a
# random-weight 'bench' model (made once under .kvlayer/models), float32 on the CPU. Chat users
# with long histories take turns; the engine's KV cache holds one conversation while the working
# set is ~5x that. Compares the engine's own prefix cache ("engine") with kvlayer's CPU + NVMe
# tiers below it ("cpu+nvme", files under .kvlayer/cache); prints TTFT and tokens/s per
# configuration, the ratios, and where the JSON and the plot were written. Extra arguments go
# to the benchmark (e.g. --configs recompute,engine,cpu,cpu+nvme,nvme).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh main
out=.kvlayer/results
exec .venv/bin/kvlayer bench multi-round-qa --configs engine,cpu+nvme --users 6 --rounds 3 \
    --json "$out/multi_round_qa.json" --plot "$out/multi_round_qa.png" "$@"
