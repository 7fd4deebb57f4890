#!/usr/bin/env bash
# Multi-round QA over HTTP, with a working set several times the engine's KV cache:
# `kvlayer bench multi-round-qa --endpoint` against a server without kvlayer (its own prefix
# cache on), then against the same server with kvlayer's CPU + NVMe tiers below that cache, same
# workload, back to back. SERVER=vllm (the default): vLLM's own OpenAI server, then with kvlayer's
# connector (runs "vllm" and "kvlayer"). SERVER=kvlayer: `kvlayer serve --no-kvlayer`, then
# `kvlayer serve --kv-config` (runs "engine" and "kvlayer").
# Each server runs on a free port in its own process group and is stopped before the next starts;
# a trap stops it on any exit. Prints both runs side by side with the ratios, the engine's KV
# capacity in tokens (vLLM's start-up log, or kvlayer serve's /metrics) and the working set over it.
#
# Usage: [SERVER=vllm|kvlayer] scripts/http-multi-round-qa.sh [extra bench flags, given to both runs]
# Settings (environment, defaults in brackets):
#   SERVER [vllm]
#   MODEL [.kvlayer/models/bench-0, made with `kvlayer model init --preset bench` if missing]
#   OUT [.kvlayer/results/SERVER-mrqa]: server logs, JSON, plots, the NVMe tier's files (emptied first)
#   USERS [8] ROUNDS [4] WARMUP_ROUNDS [1] SYSTEM_TOKENS [512] HISTORY_TOKENS [2048]
#   QUESTION_TOKENS [32] ANSWER_TOKENS [16] RATE [1] (requests/s, Poisson)
#   KV_GIB [1]: VLLM_CPU_KVCACHE_SPACE; KV_BLOCKS [128]: vLLM's --num-gpu-blocks-override, "" for
#     none, and kvlayer serve's KV cache in blocks (--kv-cache-memory of that many blocks)
#     (1 GiB, vLLM's smallest setting, holds ~43k tokens of the bench model: a working set 4x that
#     would take far longer than a few minutes to prefill on 2 cores, so the blocks are capped)
#   BLOCK_SIZE [32] CHUNK_SIZE [256] (kvlayer's chunk_size, a multiple of BLOCK_SIZE)
#   CPU_CAPACITY [half the working set's KV, so NVMe serves too] NVME_CAPACITY [64GiB]
#   TP [1]: vLLM's --tensor-parallel-size (SERVER=vllm; ranks bound to shares of the cores through
#     VLLM_CPU_OMP_THREADS_BIND, "0|1" for 2 ranks on 2 cores; kvlayer stores a shard per rank)
#   MAX_MODEL_LEN [the largest request, rounded up to a block] STARTUP_TIMEOUT [300] (seconds)
# SERVER=vllm needs vLLM's CPU build in .venv (scripts/setup.sh test). Timings mean something only
# on an otherwise quiet machine: vLLM binds its OpenMP threads to the cores.
set -euo pipefail
cd "$(dirname "$0")/.."

py=.venv/bin/python
server="${SERVER:-vllm}"
case "$server" in vllm | kvlayer) ;; *) echo "SERVER must be vllm or kvlayer, got '$server'" >&2; exit 2 ;; esac
model="${MODEL:-.kvlayer/models/bench-0}"
out="${OUT:-.kvlayer/results/$server-mrqa}"
users="${USERS:-8}" rounds="${ROUNDS:-4}" warmup="${WARMUP_ROUNDS:-1}"
system="${SYSTEM_TOKENS:-512}" history="${HISTORY_TOKENS:-2048}"
question="${QUESTION_TOKENS:-32}" answer="${ANSWER_TOKENS:-16}" rate="${RATE:-1}"
kv_gib="${KV_GIB:-1}" kv_blocks="${KV_BLOCKS-128}" block="${BLOCK_SIZE:-32}" chunk="${CHUNK_SIZE:-256}"
startup_timeout="${STARTUP_TIMEOUT:-300}"
tp="${TP:-1}"
case "$tp" in '' | *[!0-9]* | 0) echo "TP must be a positive integer, got '$tp'" >&2; exit 2 ;; esac
if [ "$tp" -gt 1 ] && [ "$server" != vllm ]; then
    echo "TP > 1 needs SERVER=vllm" >&2
    exit 2
fi

if [ "$server" = vllm ] && ! "$py" -c "import vllm" 2>/dev/null; then
    echo "vLLM is not installed in .venv (run scripts/setup.sh test)" >&2
    exit 1
fi
if [ ! -f "$model/config.json" ]; then
    echo "making the model $model (kvlayer model init --preset bench)"
    .venv/bin/kvlayer model init --preset bench --out "$model"
fi

max_request=$((system + history + rounds * (question + answer)))
working_set=$((system + users * (max_request - system)))
max_model_len="${MAX_MODEL_LEN:-$(( (max_request + block - 1) / block * block ))}"
# float32 KV bytes per token: layers * (K and V) * KV heads * head size * 4 bytes
kv_per_token="$("$py" -c 'import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
print(c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head * 4)' "$model")"
cpu_capacity="${CPU_CAPACITY:-$(( working_set * kv_per_token / 2 / 1048576 ))MiB}"
nvme_capacity="${NVME_CAPACITY:-64GiB}"

mkdir -p "$out"
out="$(cd "$out" && pwd)"
nvme="$out/nvme"

pgid=""
stop_server() {
    # TERM the server's whole process group (the API server and its EngineCore children), KILL
    # what is left after 30 s
    [ -n "$pgid" ] || return 0
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for _ in $(seq 60); do
        kill -0 -- "-$pgid" 2>/dev/null || { pgid=""; return 0; }
        sleep 0.5
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
    pgid=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

free_port() {
    "$py" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# start_server LABEL [server flags...]: start the server on a free port in a process group of its
# own and wait for /health; sets $port and $pgid, logs to $out/LABEL.server.log
start_server() {
    local label="$1"
    shift
    local log="$out/$label.server.log"
    port="$(free_port)"
    # a process started from a script is no group leader, so setsid makes it one without forking
    if [ "$server" = vllm ]; then
        local override=()
        [ -z "$kv_blocks" ] || override=(--num-gpu-blocks-override "$kv_blocks")
        local bind="${VLLM_CPU_OMP_THREADS_BIND:-}"
        if [ "$tp" -gt 1 ]; then
            override+=(--tensor-parallel-size "$tp" --distributed-executor-backend mp)
            [ -n "$bind" ] || bind="$("$py" -c 'import os, sys
from kvlayer.benchmarks.vllm_bench import rank_cores
print(rank_cores(int(sys.argv[1]), os.cpu_count() or 1))' "$tp")"
        fi
        VLLM_CPU_OMP_THREADS_BIND="${bind:-auto}" VLLM_CPU_KVCACHE_SPACE="$kv_gib" setsid "$py" -m vllm.entrypoints.openai.api_server \
            --model "$model" --port "$port" --host 127.0.0.1 --dtype float32 --block-size "$block" \
            --max-model-len "$max_model_len" --enable-prefix-caching --enforce-eager --skip-tokenizer-init \
            --enable-prompt-tokens-details --seed 0 "${override[@]}" "$@" >"$log" 2>&1 </dev/null &
    else
        setsid .venv/bin/kvlayer serve --model "$model" --port "$port" --block-size "$block" \
            --kv-cache-memory "$(( ${kv_blocks:-128} * block * kv_per_token ))" --max-model-len "$max_model_len" \
            "$@" >"$log" 2>&1 </dev/null &
    fi
    pgid=$!
    echo "$label: $server on port $port (process group $pgid), log $log"
    local started=$SECONDS
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        if ! kill -0 "$pgid" 2>/dev/null || [ $((SECONDS - started)) -ge "$startup_timeout" ]; then
            echo "$label: the server did not become healthy; the end of its log:" >&2
            tail -n 30 "$log" >&2
            exit 1
        fi
        sleep 2
    done
    echo "$label: healthy after $((SECONDS - started)) s"
}

# run_config LABEL [server flags...]: one server, one bench run into $out/LABEL.json (the script's
# own arguments go to the bench)
run_config() {
    local label="$1"
    start_server "$@"
    echo "$label: load average $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/kvlayer bench multi-round-qa --endpoint "http://127.0.0.1:$port" --model "$model" \
        --users "$users" --rounds "$rounds" --warmup-rounds "$warmup" --system-tokens "$system" \
        --history-tokens "$history" --question-tokens "$question" --answer-tokens "$answer" --rate "$rate" \
        --label "$label" --json "$out/$label.json" --plot "$out/$label.png" "${bench_args[@]}"
    curl -sf "http://127.0.0.1:$port/metrics" >"$out/$label.metrics.txt" || true
    stop_server
}

bench_args=("$@")
rm -rf "$nvme"
rm -f "$out"/*.json "$out"/*.png "$out"/*.server.log "$out"/*.metrics.txt
connector="$("$py" -c 'import json, sys
extra = {"cpu_capacity": sys.argv[1], "nvme_path": sys.argv[2], "nvme_capacity": sys.argv[3],
         "chunk_size": int(sys.argv[4])}
print(json.dumps({"kv_connector": "KVLayerConnectorV1", "kv_connector_module_path": "kvlayer.connectors.vllm_v1",
                  "kv_role": "kv_both", "kv_connector_extra_config": extra}))' \
    "$cpu_capacity" "$nvme" "$nvme_capacity" "$chunk")"
echo "working set $working_set tokens ($users users, largest request $max_request tokens);" \
    "KV_GIB=$kv_gib KV_BLOCKS=${kv_blocks:-none} TP=$tp; kvlayer CPU tier $cpu_capacity, NVMe under $nvme"

if [ "$server" = vllm ]; then
    base=vllm
    run_config vllm
    run_config kvlayer --kv-transfer-config "$connector"
else
    base=engine
    printf 'cpu_capacity: %s\nnvme_path: %s\nnvme_capacity: %s\nchunk_size: %s\n' \
        "$cpu_capacity" "$nvme" "$nvme_capacity" "$chunk" >"$out/kvlayer.yaml"
    run_config engine --no-kvlayer
    run_config kvlayer --kv-config "$out/kvlayer.yaml"
fi

"$py" - "$out" "$working_set" "$base" "$block" <<'EOF'
import json, re, sys
from pathlib import Path

out, working_set, base, block = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])


def log_of(label):
    return (out / f"{label}.server.log").read_text(errors="replace")


def capacity(label):
    """The engine's KV capacity in tokens: vLLM's start-up log, or kvlayer serve's /metrics."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log_of(label))
    if found:
        return int(found[-1].replace(",", ""))
    path = out / f"{label}.metrics.txt"
    blocks = re.findall(r"^kvlayer_serve_kv_blocks (\S+)$", path.read_text() if path.exists() else "", re.M)
    return int(float(blocks[-1])) * block if blocks else None


def blocks_of_kv_gib(label):
    """How many blocks vLLM's KV_GIB would have held, where KV_BLOCKS capped them."""
    found = re.findall(r"Overriding num_gpu_blocks=(\d+)", log_of(label))
    return int(found[-1]) if found else None


def counters(label):
    """vLLM's own counters at the end of the run (GET /metrics), summed over their labels."""
    path = out / f"{label}.metrics.txt"
    totals = {}
    for name, n in re.findall(r"^vllm:(num_preemptions|prefix_cache_queries|prefix_cache_hits|"
                              r"external_prefix_cache_queries|external_prefix_cache_hits)_total\{[^}]*\} (\S+)$",
                              path.read_text() if path.exists() else "", re.M):
        totals[name] = totals.get(name, 0) + int(float(n))
    return totals


def transfers(label):
    """kvlayer's connector counts, summed over the "KV Transfer metrics" lines of vLLM's log."""
    totals = {}
    for line in re.findall(r"KV Transfer metrics: (.*)", log_of(label)):
        for name, n in re.findall(r"'?(\w+)'?[=:] ?(\d+)", line):
            totals[name] = totals.get(name, 0) + int(n)
    return totals


runs = {label: json.loads((out / f"{label}.json").read_text())["results"][0] for label in (base, "kvlayer")}
rows = [("requests (failed)", lambda r: f"{r['requests']} ({r['failed']})"),
        ("TTFT mean s", lambda r: f"{r['ttft_s']['mean']:.3f}"), ("TTFT p50 s", lambda r: f"{r['ttft_s']['p50']:.3f}"),
        ("TTFT p90 s", lambda r: f"{r['ttft_s']['p90']:.3f}"), ("TTFT p99 s", lambda r: f"{r['ttft_s']['p99']:.3f}"),
        ("ITL mean s", lambda r: f"{r['itl_s']['mean']:.4f}"), ("req/s", lambda r: f"{r['request_per_s']:.3f}"),
        ("gen tok/s", lambda r: f"{r['generated_tok_per_s']:.2f}"),
        ("prompt tok/s", lambda r: f"{r['prompt_tok_per_s']:.1f}"),
        ("cached share", lambda r: "n/a" if r["cached_share"] is None else f"{r['cached_share']:.3f}"),
        ("span s", lambda r: f"{r['span_s']:.1f}")]
print(f"\n{'measured turns':20} {base:>12} {'kvlayer':>12}")
for name, cell in rows:
    print(f"{name:20} {cell(runs[base]):>12} {cell(runs['kvlayer']):>12}")
v, k = runs[base], runs["kvlayer"]
cap = capacity(base)
print(f"\nmean TTFT {base}/kvlayer = {v['ttft_s']['mean'] / k['ttft_s']['mean']:.2f}x; "
      f"generated tok/s kvlayer/{base} = {k['generated_tok_per_s'] / v['generated_tok_per_s']:.2f}x; "
      f"cached share {base} {v['cached_share'] or 0:.3f}, kvlayer {k['cached_share'] or 0:.3f}")
if cap:
    print(f"the engine's KV capacity {cap:,} tokens (kvlayer run: {capacity('kvlayer') or 0:,}); "
          f"working set {working_set:,} tokens = {working_set / cap:.2f}x")
    if blocks_of_kv_gib(base):
        print(f"(KV_BLOCKS capped the blocks; VLLM_CPU_KVCACHE_SPACE alone would have given "
              f"{blocks_of_kv_gib(base):,} blocks)")
else:
    print(f"the engine's KV capacity was not found; working set {working_set:,} tokens")
if base == "vllm":
    for label in ("vllm", "kvlayer"):
        print(f"{label}: vLLM's counters over the whole run (warm-up included): {counters(label) or 'none read'}")
    print(f"kvlayer connector (vLLM's KV Transfer metrics, summed): {transfers('kvlayer') or 'none logged'}")
print(f"JSON, plots and server logs in {out}")
EOF
