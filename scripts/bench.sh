#!/usr/bin/env bash
# Issue 8's benchmark matrix on the local GPU(s): `chunkring-launch bench` at both realistic shapes, FP8
# and bf16 payloads, with and without an SM partition, one rank and several under MPS; the input-check
# cost; one timeline (Chrome trace JSON, plotted to PNG where matplotlib is installed).
#   CHUNKRING_COMMIT=<sha> CHUNKRING_TREE_MODIFIED=<0|1> [BENCH_KEYS='tokens=128 ...'] scripts/bench.sh [RANKS]
# BENCH_KEYS: keys every chunkring-launch bench run takes last (the gpu_suite `commands` part's small preset).
# Results: $BENCH_RESULTS (default benchmarks/results); in a checkout the commit and whether the tree differs from
# it come from git. Every figure is a CUDA-graph replay median (chunkring.testing.bench_moe);
# scripts/results_index.py lists the result files in benchmarks/results/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-4}
results=${BENCH_RESULTS:-benchmarks/results}
mkdir -p "$results"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
commit=${CHUNKRING_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export CHUNKRING_COMMIT=${commit//[^A-Za-z0-9._-]/-}
if [ -z "${CHUNKRING_TREE_MODIFIED:-}" ] && git rev-parse --git-dir >/dev/null 2>&1; then
    if [ -n "$(git status --porcelain)" ]; then CHUNKRING_TREE_MODIFIED=1; else CHUNKRING_TREE_MODIFIED=0; fi
fi
export CHUNKRING_TREE_MODIFIED=${CHUNKRING_TREE_MODIFIED:-}
prefix="$results/$CHUNKRING_COMMIT"
if ! python3 -c "import chunkring.testing.bench_moe" 2>/dev/null; then  # an install older than this layout
    echo "bench.sh: chunkring.testing.bench_moe is not importable; reinstall chunkring (pip install -e .)" >&2
    exit 2
fi
status=0
bench() {  # name launcher-args...: BENCH_KEYS (key=value words) follow and so win, e.g. a small preset for a quick run
    local name=$1; shift
    echo "== bench $name: chunkring-launch $* ${BENCH_KEYS:-}"
    # shellcheck disable=SC2086  # BENCH_KEYS: several words
    chunkring-launch "$@" ${BENCH_KEYS:-} --json "$prefix-bench-$name.json" || status=1
}
# The handshake-vs-chunk-size sweep and the decode-to-prefill range, DeepSeek-V4-Flash-like, FP8, with the
# timeline of 2,048 tokens in 256-token chunks.
bench 1rank-flash bench --config bench "trace_out=\"$prefix-timeline-flash-2048x256\""
# DeepSeek-V3-like: 256 experts, top-8, hidden 7168.
bench 1rank-v3 bench --config bench_v3
# bf16 payload; the producers on a 16-SM green-context partition.
bench 1rank-flash-bf16 bench --config bench 'payload="bf16"' 'tokens="128,2048"' 'chunks="256"' 'trace=""'
bench 1rank-flash-sm16 bench --config bench producer_sms=16 'tokens="128,2048"' 'chunks="256"' 'trace=""'
# Several ranks sharing the GPU under MPS (expert parallel over ranks; four processes time-share one GPU).
bench "${ranks}rank-mps-flash" --np "$ranks" --mps bench --config bench 'tokens="128,2048"' 'chunks="256,1024"' 'trace=""' \
    max_tokens_per_rank=2048
python3 -m benchmarks.bench_input_checks --json "$prefix-input_checks_1rank.json" || status=1
for trace in "$prefix"-timeline-*-batch.json "$prefix"-timeline-*-streamed.json; do
    [ -f "$trace" ] && python3 scripts/plot_timeline.py "$trace" -o "${trace%.json}.png" 2>/dev/null
done
exit $status
