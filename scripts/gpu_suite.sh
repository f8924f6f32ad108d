#!/usr/bin/env bash
# On a GPU host without network: install the wheel bundle, build the kernels (cold, then from the cache),
# run the GPU test suite with 1 rank and with N ranks on one GPU under MPS, run the main job, and
# write one JSON summary per suite run into $RESULTS (default tests/gpu_results); with $OUT set (the
# device tool), also pack them and the log into $OUT/gpu_results.tgz.
#   CHUNKRING_COMMIT=<sha> CHUNKRING_TREE_MODIFIED=<0|1> scripts/gpu_suite.sh [BUNDLE_DIR] [RANKS] [PART...]
# PART: gpu_1rank stress_1rank jobs_1rank gpu_mps moe_2rank_mps stress_mps bench_mps jobs_mps launcher (default:
# all, in that order) - to split the suite over device calls; serving_1rank / serving_mps run only the serving-stack
# tests (custom op, transformers drop-in, integration guide), which the full parts include; gpu_1rank_rma / gpu_mps_rma
# run the GPU tests with every peer on the RMA data path (pytest --transport rma: NVSHMEM gets/puts, self included);
# transport_1rank / transport_mps run the main job on the direct and on the forced-RMA data path (their cost);
# overlap_1rank / overlap_mps run benchmarks/bench_overlap.py (batch-ready, streamed and auto vs the overlap bound,
# at most 240 s); producer_ncu runs Nsight Compute on the fused producer kernel (benchmarks/probe_producer.py
# --profile-once); partition_mps runs the main job with the default partition and with none (interleaved);
# faults_mps runs the fault matrix (tests/faults: usage error, device error, hang x first call, streamed call, graph
# replay, reset, destroy at $ranks ranks under MPS); faults_kill the kill cells through chunkring-launch --mps,
# which starts its own daemon; lifetime_mps runs LIFETIME_CYCLES (default 1000) create/call/destroy cycles of a
# small layer at LIFETIME_RANKS ranks (default 4), stopping after LIFETIME_SECONDS (default 300) with the count it
# reached (tests/lifetime: heap, green contexts and device memory flat, output exact).
# decode_1rank runs the decode path's GPU tests, then benchmarks/bench_decode.py (decode vs DeepGEMM vs MegaMoE;
# DECODE_ARGS, default flash at 1-128 tokens); decode_ncu records the decode kernels' achieved DRAM bandwidth with
# Nsight Compute, then decode_stalls where one L1 and one L2 launch at 8 tokens stall, after a one-kernel probe that
# ncu can profile here (producer_ncu likewise). smoke_1rank runs the newest device paths' tests first and stops at the
# first failure: a short first call of a session; smoke_mps runs them at $ranks ranks under MPS. quick_1rank runs the
# GPU tests but the input fuzzer. call_kernels lists every kernel of a small layer call's graph replay, as the GPU
# ran it (benchmarks/probe_call_kernels.py: where a decode-sized call's time goes). graph_launch_1rank times the
# host's launch of that graph, torch's replay against the driver's and against a plain graph of as many kernels
# (benchmarks/probe_graph_launch.py). megamoe_1rank runs benchmarks/bench_vs_megamoe.py (the layer against MegaMoE
# and the torch peer, graph with graph; MEGAMOE_ARGS); breakdown_1rank benchmarks/bench_consumer_breakdown.py (a
# batch-ready call's steps timed alone). bisect_1rank runs the GPU tests BISECT_TESTS names (pytest arguments) on each
# earlier tree scripts/carry_trees.sh put in .carry/trees, in its order, until one passes: the commit after that tree
# broke them (one summary per tree, named by its commit). decode_trees runs the decode benchmark on each such tree: an
# earlier commit's kernels against this tree's on the same card. eager_1rank / eager_mps run benchmarks/bench_eager.py
# (an eager MoELayer.run's host issue, eager, pipelined and graph times against MegaMoE's; EAGER_ARGS, EAGER_LIMIT_S).
# weight_read_1rank runs benchmarks/probe_weight_read.py: how fast the card reads the experts' FP8 weights against bytes
# in flight (the persistent decode consumer's weight loader alone, swept; WEIGHT_READ_ARGS, WEIGHT_READ_LIMIT_S).
# model_1rank / model_mps run benchmarks/bench_model.py: a transformers MoE model's prefill and decode steps, eager and
# compiled, its own experts against the drop-in batch-ready and streamed (MODEL_ARGS, MODEL_LIMIT_S).
# persistent_1rank runs the persistent decode consumer's GPU tests (tests/gpu/test_moe_persistent.py), then
# benchmarks/bench_persistent.py (against the decode kernels and DeepGEMM's path at 1-512 tokens, its variants swept;
# PERSISTENT_ARGS, PERSISTENT_LIMIT_S), after its kernel's SASS counted by instruction; the bench runs even when a test
# fails (each is a process of its own), so that one device call brings both.
# commands runs every command README.md and docs/LAUNCHER.md show (tests/helpers/doc_commands.py lists them) at a
# small preset, at 1 rank and at 4 ranks under the launcher's own MPS daemon, each ending with the status the docs
# give it: one record; commands_1rank / commands_4rank split it over two device calls (records commands-1rank and
# commands-4rank-mps); COMMANDS_SELECT narrows any of them. Each command's status and time are printed as it ends, so
# the log of a part cut short says what ran. Run it whenever device, runtime or launcher code changes.
# Summaries are named <commit>-<suite>.json. The device copy has no .git, so its caller passes the commit and
# whether the tree differs from it (git status --porcelain not empty: 1); in a checkout both come from git.
# Commit the summaries with the indexes rebuilt: python scripts/results_index.py.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-.whl}
ranks=${2:-4}
default_parts=(gpu_1rank stress_1rank jobs_1rank gpu_mps moe_2rank_mps stress_mps bench_mps jobs_mps launcher)
all_parts=("${default_parts[@]}" serving_1rank serving_mps gpu_1rank_rma gpu_mps_rma overlap_1rank overlap_mps producer_probe
           transport_1rank transport_mps partition_mps producer_ncu faults_mps faults_kill lifetime_mps smoke_1rank
           decode_1rank decode_trees decode_ncu decode_stalls quick_1rank smoke_mps call_kernels megamoe_1rank breakdown_1rank
           bisect_1rank eager_1rank eager_mps commands commands_1rank commands_4rank weight_read_1rank model_1rank
           model_mps persistent_1rank graph_launch_1rank bench_variants_4rank)
parts=("${@:3}")
[ ${#parts[@]} -gt 0 ] || parts=("${default_parts[@]}")
for part in "${parts[@]}"; do
    [[ " ${all_parts[*]} " == *" $part "* ]] || { echo "unknown part: $part (${all_parts[*]})" >&2; exit 2; }
done
results=${RESULTS:-tests/gpu_results}
logs=${LOGS:-/tmp/chunkring-logs}
BENCH_RESULTS=${BENCH_RESULTS:-benchmarks/results}
mkdir -p "$results" "$logs" "$BENCH_RESULTS"
# Absolute: the parts that run an earlier tree (bisect_1rank, decode_trees) write their records from inside it.
results=$(cd "$results" && pwd) logs=$(cd "$logs" && pwd) BENCH_RESULTS=$(cd "$BENCH_RESULTS" && pwd)
export BENCH_RESULTS
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CHUNKRING_CACHE_DIR=${CHUNKRING_CACHE_DIR:-/tmp/chunkring-cache}
# Forwarded to ranks by name, so it must be set; it names the result files, so keep it to [A-Za-z0-9._-]
# (the device tool returns no file whose name holds anything else).
commit=${CHUNKRING_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export CHUNKRING_COMMIT=${commit//[^A-Za-z0-9._-]/-}
# Every record says whether the tree that ran was its commit (chunkring.testing.records.tree_modified).
if [ -z "${CHUNKRING_TREE_MODIFIED:-}" ] && git rev-parse --git-dir >/dev/null 2>&1; then
    if [ -n "$(git status --porcelain)" ]; then CHUNKRING_TREE_MODIFIED=1; else CHUNKRING_TREE_MODIFIED=0; fi
fi
export CHUNKRING_TREE_MODIFIED=${CHUNKRING_TREE_MODIFIED:-}

# Keep the host's torch: install only what the image lacks, without dependency resolution.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1

status=0
# A kernel that does not build fails the run (the suites would fail on it anyway, less clearly).
python3 scripts/build_kernels.py --json "$logs/build_cold.json" 2>&1 | tee "$logs/build.log" || status=1
python3 scripts/build_kernels.py --json "$logs/build_warm.json" 2>&1 | tee -a "$logs/build.log" || status=1

run_suite() {  # name ranks command...
    local name=$1 n=$2; shift 2
    local start=$SECONDS
    # A report left by an earlier run of this name (bisect_1rank reuses one per tree) must not stand in for a
    # run that died before writing its own.
    rm -f "$logs/$name".xml*
    "$@" 2>&1 | tee "$logs/$name.log"
    local rc=${PIPESTATUS[0]}
    python3 scripts/gpu_summary.py --suite "$name" --ranks "$n" --rc "$rc" --seconds $((SECONDS - start)) \
        --junit "$logs/$name".xml* --build "$logs/build_cold.json" "$logs/build_warm.json" \
        --command "$*" --out "$results/${CHUNKRING_COMMIT:-unknown}-$name.json"
    return "$rc"
}
# faulthandler dumps every thread's stack if a test outlives the limit, naming where it waits.
limits=(--timeout 240 -o faulthandler_timeout=200)
# Parts: 1-rank ones run without an MPS daemon; *_mps ones share one daemon, started by the first of them.
gpu_1rank() {  # the CPU suite (kernel compilation included) is CI's job; the GPU host runs what needs a GPU
    run_suite gpu-1rank 1 python3 -m pytest tests/gpu tests/mpi --ignore=tests/mpi/test_launcher_mpi.py -v -rs \
        --durations=8 "${limits[@]}" --junitxml="$logs/gpu-1rank.xml" || status=1
}
# The layer's newest device paths: the MoE descriptors (plan, pull into blocks, waves), failing closed (the failure
# word, a failed call's zeros, the abort), the decode kernels, the reduction, routing captured into a graph, eager
# calls replayed from the layer's own graphs, the one-rank path.
smoke_tests=(tests/gpu/test_moe_experts.py tests/gpu/test_wave_claim.py tests/gpu/test_moe_blocks.py
             tests/gpu/test_fail_closed.py tests/gpu/test_abort.py tests/gpu/test_moe_decode.py
             tests/gpu/test_moe_reduce.py tests/gpu/test_router.py tests/gpu/test_call_replay_gpu.py
             tests/gpu/test_partition_gpu.py tests/gpu/test_moe_one_rank.py)
smoke_1rank() {  # the newest device paths first, stopping at the first failure (a few minutes), before the whole suite
    run_suite smoke-1rank 1 python3 -m pytest "${smoke_tests[@]}" -x -v -rs \
        --durations=8 "${limits[@]}" --junitxml="$logs/smoke-1rank.xml" || status=1
}
unpack_tree() {  # tree: that carried tree (scripts/carry_trees.sh), unpacked afresh under /tmp/trees
    rm -rf "/tmp/trees/$1" && mkdir -p "/tmp/trees/$1" && tar -C "/tmp/trees/$1" -xzf ".carry/trees/$1.tgz"
}
in_tree() {  # tree command...: the command inside that unpacked tree - its package and kernels ahead of the editable
    # install of this one, its own tests, benchmarks and scripts, its records named by its commit
    local tree=$1 dir=/tmp/trees/$1
    shift
    (cd "$dir" && export PYTHONPATH="$dir/runtime:$dir/launcher:$PYTHONPATH" CHUNKRING_COMMIT=$tree \
        CHUNKRING_TREE_MODIFIED=0 && "$@")
}
bisect_1rank() {
    if [ -z "${BISECT_TESTS:-}" ] || [ ! -f .carry/trees/ORDER ]; then
        echo "bisect_1rank: set BISECT_TESTS and carry the trees of scripts/carry_trees.sh"; status=1; return
    fi
    local tree
    while read -r tree; do
        unpack_tree "$tree" || { status=1; return; }
        # shellcheck disable=SC2086  # BISECT_TESTS: several pytest arguments
        in_tree "$tree" run_suite bisect-1rank 1 python3 -m pytest $BISECT_TESTS -x -v -rs "${limits[@]}" \
            --junitxml="$logs/bisect-1rank.xml"
        local rc=$?
        mv "$logs/bisect-1rank.log" "$logs/bisect-1rank-$tree.log"
        if [ "$rc" = 0 ]; then
            echo "bisect_1rank: $tree passes $BISECT_TESTS" | tee -a "$logs/driver.log"
            return
        fi
        echo "bisect_1rank: $tree fails $BISECT_TESTS" | tee -a "$logs/driver.log"
    done < .carry/trees/ORDER
}
decode_trees() {  # benchmarks/bench_decode.py of each tree in .carry/trees (DECODE_ARGS as decode_1rank's): an earlier
    # commit's decode kernels timed on the same card in the same call as this tree's, its record named by its commit
    [ -f .carry/trees/ORDER ] || { echo "decode_trees: carry the trees of scripts/carry_trees.sh"; status=1; return; }
    local tree
    while read -r tree; do
        unpack_tree "$tree" || { status=1; return; }
        in_tree "$tree" decode_bench "$logs/decode-$tree.log" || status=1
    done < .carry/trees/ORDER
}
quick_1rank() {  # the GPU tests but the input fuzzer (its ~90 s), for a short device call after a host change
    run_suite quick-1rank 1 python3 -m pytest tests/gpu --ignore=tests/gpu/test_fuzz_inputs.py -v -rs \
        --durations=8 "${limits[@]}" --junitxml="$logs/quick-1rank.xml" || status=1
}
gpu_1rank_rma() {  # the same GPU tests, every ring forced onto the RMA data path
    run_suite gpu-1rank-rma 1 python3 -m pytest tests/gpu -v -rs --durations=8 "${limits[@]}" --transport rma \
        --junitxml="$logs/gpu-1rank-rma.xml" || status=1
}
stress_1rank() {
    run_suite stress-1rank 1 python3 -m pytest tests/stress -q -rA "${limits[@]}" --junitxml="$logs/stress-1rank.xml" || status=1
}
jobs_1rank() {
    for job in bringup run; do
        chunkring-launch $job --json "$results/${CHUNKRING_COMMIT}-${job}-1rank.json" 2>&1 | tee -a "$logs/main.log" || status=1
    done
}
# mpirun forwarding what every rank needs: the carried packages, the MPS pipe, the kernel cache.
mpi=(mpirun --oversubscribe -x PYTHONPATH -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY
     -x CHUNKRING_CACHE_DIR -x CHUNKRING_COMMIT -x CHUNKRING_TREE_MODIFIED)
mpi_pytest() {  # suite ranks timeout pytest-args...: one JUnit file per rank
    local suite=$1 n=$2 limit=$3; shift 3
    # Without the daemon the ranks' contexts time-slice the GPU: spinning kernels then wait out whole slices, and
    # the suite measures the scheduler, not the ring.
    [ $mps_daemon = 1 ] || { echo "$suite: no MPS daemon (a part that runs ranks under MPS is named *_mps or *_mps_*)"; status=1; return; }
    run_suite "$suite" "$n" "${mpi[@]}" -np "$n" --timeout "$limit" \
        bash -c "exec python3 -m pytest --with-mpi $* --junitxml=$logs/$suite.xml.\$OMPI_COMM_WORLD_RANK"
}
# The launcher's harness tests (tests/mpi/test_launcher_mpi.py) start an mpirun of their own, which cannot start
# inside this mpirun job on the GPU host (Open MPI 4.1.6 then looks for ssh/rsh); they need no GPU, and CI runs them.
# GPU_TESTS narrows gpu_mps / gpu_mps_rma to those pytest paths (a device call too short for the whole suite); their
# records are then named gpu-<N>rank-mps-selected(-rma), the paths in their command.
# GPU_MPS_LIMIT_S (500 s) bounds each of the two, below a device call's own limit so that a run cut short still writes
# its record. -v: each rank's log names every test it started, so a cut run shows where each rank was.
gpu_mps() {
    # shellcheck disable=SC2086
    mpi_pytest "gpu-${ranks}rank-mps${GPU_TESTS:+-selected}" "$ranks" "${GPU_MPS_LIMIT_S:-500}" \
        ${GPU_TESTS:-tests/gpu tests/mpi} --ignore=tests/mpi/test_launcher_mpi.py -v -rs "${limits[*]}" || status=1
}
gpu_mps_rma() {
    # shellcheck disable=SC2086
    mpi_pytest "gpu-${ranks}rank-mps${GPU_TESTS:+-selected}-rma" "$ranks" "${GPU_MPS_LIMIT_S:-500}" \
        ${GPU_TESTS:-tests/gpu} --transport rma -v -rs "${limits[*]}" || status=1
}
moe_2rank_mps() {  # the MoE layer and the transformers drop-in at a second rank count
    mpi_pytest "moe-2rank-mps" 2 300 tests/gpu/test_moe_layer.py tests/gpu/test_hf_dropin_model.py -q -rs "${limits[*]}" ||
        status=1
}
serving_tests=(tests/gpu/test_custom_op_gpu.py tests/gpu/test_hf_dropin_model.py tests/gpu/test_integration_guide.py)
serving_1rank() {
    run_suite serving-1rank 1 python3 -m pytest "${serving_tests[@]}" -v -rs "${limits[@]}" \
        --junitxml="$logs/serving-1rank.xml" || status=1
}
serving_mps() {  # at $ranks (moe_2rank_mps runs the drop-in at 2)
    mpi_pytest "serving-${ranks}rank-mps" "$ranks" 400 "${serving_tests[*]}" -q -rs "${limits[*]}" || status=1
}
smoke_mps() {  # the same at $ranks ranks under MPS (a failed call's zeros and the abort need peers)
    mpi_pytest "smoke-${ranks}rank-mps" "$ranks" 400 "${smoke_tests[*]}" -x -q -rs "${limits[*]}" || status=1
}
stress_mps() { mpi_pytest "stress-${ranks}rank-mps" "$ranks" 400 tests/stress -q -rA "${limits[*]}" || status=1; }
bench() {  # ranks name script args...: one benchmark under mpirun, its JSON named <commit>-<name>.json
    local n=$1 name=$2; shift 2
    "${mpi[@]}" -np "$n" --timeout 120 python3 "$@" \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT:-unknown}-$name.json" 2>&1 |
        tee -a "$logs/bench.log" || status=1
}
bench_mps() {
    bench 2 ring_latency_2rank_mps -m benchmarks.bench_ring_latency
    for n in 2 4 8; do  # the ack's cost against the rank count (one remote swap per chunk and destination)
        bench "$n" "ack_cost_${n}rank_mps" -m benchmarks.bench_ring_latency --ack-cost
    done
    for n in 1 "$ranks"; do bench "$n" "input_checks_${n}rank_mps" -m benchmarks.bench_input_checks; done
}
overlap_1rank() {  # OVERLAP_ARGS / OVERLAP_LIMIT_S override the bench's arguments and time limit; the first call per
    # shape compiles DeepGEMM's kernels, outside the timings (printed). The JSON is rewritten after each shape, so
    # a run the limit cuts keeps the shapes it finished.
    local out=$BENCH_RESULTS/${CHUNKRING_COMMIT:-unknown}-overlap.json
    # shellcheck disable=SC2086
    timeout "${OVERLAP_LIMIT_S:-240}" python3 -m benchmarks.bench_overlap ${OVERLAP_ARGS:-} \
        --json "$out" 2>&1 | tee "$logs/overlap.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
overlap_mps() {  # the same at $ranks ranks sharing the GPU under MPS
    local out=$BENCH_RESULTS/${CHUNKRING_COMMIT:-unknown}-overlap-${ranks}rank-mps.json
    # shellcheck disable=SC2086
    "${mpi[@]}" -np "$ranks" --timeout "${OVERLAP_LIMIT_S:-240}" python3 -m benchmarks.bench_overlap \
        ${OVERLAP_ARGS:-} --json "$out" 2>&1 | tee "$logs/overlap-mps.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
producer_probe() {  # where a streamed chunk's production time goes (router GEMM, fused kernel, back-pressure)
    timeout 90 python3 -m benchmarks.probe_producer \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-producer-probe.json" 2>&1 | tee "$logs/probe.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
producer_ncu() {  # Nsight Compute on the fused producer kernel (no timing: where its ~28 us per 128-token chunk go)
    local ncu chunk
    ncu=$(ncu_ready) || { echo "producer_ncu: $ncu"; status=1; return; }
    for chunk in 128 1024; do
        timeout 150 "$ncu" --clock-control none -k regex:moe_produce_chunk -c 2 --section SpeedOfLight \
            --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis python3 -m benchmarks.probe_producer --chunks "$chunk" --profile-once \
            2>&1 | tee -a "$logs/producer_ncu.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
}
decode_1rank() {  # the decode path: correctness first (a failure skips the timing), then the benchmark's record;
    # DECODE_ARGS / DECODE_LIMIT_S override the bench's arguments and its time limit (the default: a short first
    # look that fits one device call beside the tests; --shapes flash,v3 and every token count take minutes more)
    run_suite decode-1rank 1 python3 -m pytest tests/gpu/test_moe_decode.py -v -rs "${limits[@]}" \
        --junitxml="$logs/decode-1rank.xml" || { status=1; return; }
    decode_bench "$logs/decode.log" || status=1
}
decode_bench() {  # log: benchmarks/bench_decode.py (DECODE_ARGS, DECODE_LIMIT_S) of the current directory's tree, its
    # record named by CHUNKRING_COMMIT
    # shellcheck disable=SC2086
    timeout "${DECODE_LIMIT_S:-180}" python3 -m benchmarks.bench_decode ${DECODE_ARGS:---shapes flash --tokens 1,8,32,128} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-decode.json" 2>&1 | tee "$1"
    return "${PIPESTATUS[0]}"
}
call_kernels() {  # CALL_KERNELS_ARGS override the probe's arguments (default: flash at 1, 8 and 128 tokens)
    # shellcheck disable=SC2086
    timeout 180 python3 -m benchmarks.probe_call_kernels ${CALL_KERNELS_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-call-kernels.json" 2>&1 | tee "$logs/call_kernels.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
graph_launch_1rank() {  # GRAPH_LAUNCH_ARGS override the probe's arguments (default: flash at 1 token)
    # shellcheck disable=SC2086
    timeout 150 python3 -m benchmarks.probe_graph_launch ${GRAPH_LAUNCH_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-graph-launch.json" 2>&1 | tee "$logs/graph_launch.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
megamoe_1rank() {  # MEGAMOE_ARGS / MEGAMOE_LIMIT_S override the bench's arguments (default: both shapes, 1-8,192
    # tokens) and its time limit; the JSON is rewritten after each shape (a run the limit cuts keeps those it finished)
    # shellcheck disable=SC2086
    timeout "${MEGAMOE_LIMIT_S:-400}" python3 -m benchmarks.bench_vs_megamoe ${MEGAMOE_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-vs-megamoe.json" 2>&1 | tee "$logs/megamoe.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
eager_1rank() {  # EAGER_ARGS / EAGER_LIMIT_S override the bench's arguments (default: flash, 1-8,192 tokens) and its
    # time limit; the JSON is rewritten after each token count (a run the limit cuts keeps those it finished)
    # shellcheck disable=SC2086
    timeout "${EAGER_LIMIT_S:-400}" python3 -m benchmarks.bench_eager ${EAGER_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-eager.json" 2>&1 | tee "$logs/eager.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
eager_mps() {  # the same at $ranks ranks sharing the GPU under MPS (MegaMoE: a one-rank instance in each rank)
    # shellcheck disable=SC2086
    "${mpi[@]}" -np "$ranks" --timeout "${EAGER_LIMIT_S:-400}" python3 -m benchmarks.bench_eager ${EAGER_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-eager-${ranks}rank-mps.json" 2>&1 | tee "$logs/eager-mps.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
model_1rank() {  # MODEL_ARGS / MODEL_LIMIT_S override the bench's arguments (default: a 4-layer model of Qwen3-30B-A3B's
    # layers, FP8 drop-in; prefill 1x2048 and 8x512, decode 1/8/64 eager, prefill_1x2048 and decode_8 compiled too) and
    # its time limit; the JSON is rewritten after each step and compiled side (a run the limit cuts keeps those)
    # shellcheck disable=SC2086
    timeout "${MODEL_LIMIT_S:-420}" python3 -m benchmarks.bench_model ${MODEL_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-model.json" 2>&1 | tee "$logs/model.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
model_mps() {  # the same at $ranks ranks sharing the GPU under MPS (each rank its own tokens; the own side a replica
    # per rank, the drop-in's experts split); by default only prefill_1x2048 compiled: the ranks compile at once
    # shellcheck disable=SC2086
    "${mpi[@]}" -np "$ranks" --timeout "${MODEL_LIMIT_S:-540}" python3 -m benchmarks.bench_model \
        ${MODEL_ARGS:---compile-steps prefill_1x2048} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-model-${ranks}rank-mps.json" 2>&1 | tee "$logs/model-mps.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
breakdown_1rank() {  # BREAKDOWN_ARGS override the bench's arguments (default: flash at 8, 1,024 and 8,192 tokens)
    # shellcheck disable=SC2086
    timeout 300 python3 -m benchmarks.bench_consumer_breakdown ${BREAKDOWN_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-breakdown.json" 2>&1 | tee "$logs/breakdown.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
count_sass() {  # source log: that kernel source's cubin (built here, or from the cache) disassembled, and the
    # instructions that show how it moves data counted into log - the copy engine's copies and prefetches, barriers,
    # register hand-over, tensor-core MMAs, shared and global loads, local memory (spills), calls
    local cubin
    cubin=$(python3 -c "from chunkring.env import cache_dir; from chunkring.jit import build
r = build('$1'); print(cache_dir() / f'{r.name}-{r.arch}-{r.cache_key}.cubin')")
    if command -v cuobjdump >/dev/null && [ -f "$cubin" ]; then
        cuobjdump --dump-sass "$cubin" >"$logs/$1.sass" &&
            grep -oE '\b(UTMALDG|UTMAPF|UBLKCP|SYNCS\.[A-Z.]+|USETMAXREG|QGMMA\.[0-9A-Zx.]+|LDS\.[0-9A-Z.]+|LDG\.[0-9A-Z.]+|LDL|STL|CALL)\b' \
                "$logs/$1.sass" | sort | uniq -c | tee "$2"
    else
        echo "$1: no cuobjdump or no cubin ($cubin): SASS not counted" | tee "$2"
    fi
}
weight_read_1rank() {  # WEIGHT_READ_ARGS / WEIGHT_READ_LIMIT_S override the probe's arguments (default: its default
    # sweep, about a minute) and its time limit; first the probe kernel's SASS, counted by instruction (the tensor-map
    # and bulk copies, barriers, register hand-over), so that its table prints last
    count_sass probe_weight_read "$logs/weight_read.log"
    # shellcheck disable=SC2086
    timeout "${WEIGHT_READ_LIMIT_S:-240}" python3 -m benchmarks.probe_weight_read ${WEIGHT_READ_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-weight-read.json" 2>&1 | tee -a "$logs/weight_read.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
persistent_1rank() {  # PERSISTENT_ARGS / PERSISTENT_LIMIT_S override the bench's arguments (default: 1-512 tokens,
    # the default sweep, a few minutes) and its time limit
    count_sass moe_persistent "$logs/persistent.log"
    run_suite persistent-1rank 1 python3 -m pytest tests/gpu/test_moe_persistent.py -v -rs "${limits[@]}" \
        --junitxml="$logs/persistent-1rank.xml" || status=1
    # shellcheck disable=SC2086
    timeout "${PERSISTENT_LIMIT_S:-300}" python3 -m benchmarks.bench_persistent ${PERSISTENT_ARGS:-} \
        --json "$BENCH_RESULTS/${CHUNKRING_COMMIT}-persistent.json" 2>&1 | tee -a "$logs/persistent.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
decode_ncu() {  # Nsight Compute on the decode path's L1 and L2 launches (moe_persistent_gemm): time, DRAM bytes read
    # and achieved DRAM bandwidth per launch, 1/8/32/128 tokens at the flash shape (--profile-once also runs
    # DeepGEMM's path, which the filter leaves out)
    local ncu tokens=1,8,32,128 out=$BENCH_RESULTS/${CHUNKRING_COMMIT}-decode-ncu.csv
    ncu=$(ncu_ready) || { echo "decode_ncu: $ncu"; status=1; return; }
    timeout 300 "$ncu" --clock-control none -k regex:moe_persistent_gemm --csv --page raw \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_read.sum.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
        --log-file "$out" python3 -m benchmarks.bench_decode --profile-once --shapes flash --tokens "$tokens" \
        2>&1 | tee "$logs/decode_ncu.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    grep -q moe_persistent_gemm "$out" 2>/dev/null || { echo "decode_ncu: no moe_persistent_gemm row in $out"; status=1; }
    python3 scripts/decode_ncu_summary.py "$out" --tokens "$tokens" --shape flash --json "${out%.csv}.json" \
        2>&1 | tee -a "$logs/decode_ncu.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    decode_stalls
}
decode_stalls() {  # where the warps of one L1 and one L2 launch at 8 tokens wait: stall reasons, scheduler, memory
    # tables, source hot spots (Nsight Compute's text report)
    local ncu
    ncu=$(ncu_ready) || { echo "decode_stalls: $ncu"; status=1; return; }
    timeout 200 "$ncu" --clock-control none -k regex:moe_persistent_gemm -c 2 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section SourceCounters --section Occupancy --section LaunchStats \
        --log-file "$BENCH_RESULTS/${CHUNKRING_COMMIT}-decode-ncu-stalls.txt" \
        python3 -m benchmarks.bench_decode --profile-once --shapes flash --tokens 8 2>&1 | tee -a "$logs/decode_ncu.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
ncu_ready() {  # prints the ncu that can profile here (one kernel, 30 s at most), or why none can, and fails
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu on this host"; return 1; }
    timeout 30 "$ncu" --clock-control none -c 1 --metrics gpu__time_duration.sum python3 -c \
        'import torch; torch.ones(1, device="cuda").add_(1); torch.cuda.synchronize()' >"$logs/ncu_probe.log" 2>&1 &&
        grep -q gpu__time_duration "$logs/ncu_probe.log" ||
        { echo "$ncu cannot profile here (counters not permitted?): see $logs/ncu_probe.log"; return 1; }
    echo "$ncu"
}
job_rounds() {  # ranks name key value...: the main job with key=value for each value, twice each, interleaved
    # (a fixed order of one run each cannot tell a value's cost from the order's), one JSON per run; a failed
    # job's per-rank diagnostics stay under the logs
    local n=$1 name=$2 key=$3 round value jobdirs=$logs/jobs
    shift 3
    mkdir -p "$jobdirs"
    for round in 1 2; do
        for value in "$@"; do
            TMPDIR=$jobdirs chunkring-launch --np "$n" run "$key=$value" \
                --json "$results/${CHUNKRING_COMMIT}-run-$value-$name-$round.json" 2>&1 | tee -a "$logs/$key.log" ||
                status=1
        done
    done
}
transport_1rank() { job_rounds 1 1rank transport auto rma; }
transport_mps() { job_rounds "$ranks" "${ranks}rank-mps" transport auto rma; }
# Whether the 4-rank main job's failures (a closed chunk its consumers did not observe) need green contexts.
partition_mps() { job_rounds "$ranks" "partition-${ranks}rank-mps" producer_sms auto none; }
jobs_mps() {
    for job in bringup run; do
        chunkring-launch --np "$ranks" $job --json "$results/${CHUNKRING_COMMIT}-${job}-${ranks}rank-mps.json" 2>&1 | tee -a "$logs/main.log" || status=1
    done
}
faults_mps() {  # the fault matrix under mpirun (record faults-<N>rank-mps); the kill cells are faults_kill
    mpi_pytest "faults-${ranks}rank-mps" "$ranks" 300 tests/faults/test_fault_matrix.py -q -rsx "${limits[*]}" ||
        status=1
}
faults_kill() {  # a rank killed at each phase, through chunkring-launch --mps, which starts its own daemon and
    # checks that none outlives the job (record faults-kill-<N>rank-mps)
    run_suite "faults-kill-${ranks}rank-mps" "$ranks" python3 -m pytest tests/faults/test_fault_kill.py -v -rs \
        --timeout 400 --junitxml="$logs/faults-kill-${ranks}rank-mps.xml" || status=1
}
lifetime_mps() {  # LIFETIME_CYCLES create/call/destroy cycles at LIFETIME_RANKS ranks; the record holds the heap, the
    # partitions and the device memory before and after
    local n=${LIFETIME_RANKS:-4}
    mpi_pytest "lifetime-${n}rank-mps" "$n" "${LIFETIME_LIMIT_S:-420}" tests/lifetime -q -rs --timeout 420 \
        -o faulthandler_timeout=400 --lifetime-cycles "${LIFETIME_CYCLES:-1000}" \
        --lifetime-seconds "${LIFETIME_SECONDS:-300}" || status=1
}
commands_part() {  # name ranks [pytest -k expression]: tests/commands (each documented command), one record. Not
    # named *_mps: the commands start their own MPS daemon (--mps), and none may be running then.
    local name=$1 n=$2 select=${3:-}
    run_suite "$name" "$n" python3 -m pytest tests/commands -v -rs --timeout 1000 ${select:+-k "$select"} \
        --junitxml="$logs/$name.xml" || status=1
}
# COMMANDS_SELECT (a pytest -k expression) narrows each to some of its commands, the record then named *-selected: the
# rest of a part that a device call's limit cut short.
commands_selected() {  # name ranks expression: the part's commands, narrowed by COMMANDS_SELECT where set
    if [ -n "${COMMANDS_SELECT:-}" ]; then
        commands_part "$1-selected" "$2" "($3) and ($COMMANDS_SELECT)"
    else
        commands_part "$1" "$2" "$3"
    fi
}
commands() { commands_selected commands 4 "1rank or 4rank or once"; }
commands_1rank() { commands_selected commands-1rank 1 "not 4rank"; }  # and those run once (doctor, bench.sh)
commands_4rank() { commands_selected commands-4rank-mps 4 "4rank"; }
# BENCH_VARIANTS: key sets separated by ';', one `chunkring-launch --np 4 --mps bench` run each (a short watchdog,
# CHUNKRING_TIMEOUT_S, 20 s unless set), its status in bench-variants.log: which shapes of a failing bench fail. Not
# *_mps: the launcher starts its own daemon. Its records stay out of the results.
bench_variants_4rank() {
    local sets v i=0
    IFS=';' read -ra sets <<< "${BENCH_VARIANTS:?BENCH_VARIANTS names the key sets}"
    for v in "${sets[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086
        (cd "$(mktemp -d)" && CHUNKRING_TIMEOUT_S=${CHUNKRING_TIMEOUT_S:-20} BENCH_RESULTS=. timeout 170 \
            chunkring-launch --np 4 --mps bench $v iterations=2 warmup=1 rotate=1) > "$logs/bench-variant-$i.log" 2>&1
        local rc=$?
        echo "variant $i [$v]: status $rc" | tee -a "$logs/bench-variants.log"
        [ $rc = 0 ] || status=1
    done
}
# Several ranks on one GPU: an MPS daemon with private directories lets their kernels run concurrently.
mps_daemon=0
mps_up() {
    [ $mps_daemon = 1 ] && return
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
    nvidia-cuda-mps-control -d && mps_daemon=1
}
mps_down() {  # quit the daemon and wait until it is gone: a later part's CUDA must not meet a dying one
    [ $mps_daemon = 1 ] || return 0
    echo quit | nvidia-cuda-mps-control
    for _ in $(seq 1 50); do pgrep -f nvidia-cuda-mps-control >/dev/null || break; sleep 0.2; done
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    mps_daemon=0
}
launcher() {
    # The launcher's own MPS daemon: stress, chaos (a delayed rank must pass; a killed rank must end the job
    # with status 5 and leave no daemon behind), doctor.
    launch() {  # expected-status name args...
        local want=$1 name=$2; shift 2
        local start=$SECONDS
        chunkring-launch --np "$ranks" --mps "$@" --timeout 300 2>&1 | tee "$logs/$name.log"
        local rc=${PIPESTATUS[0]}
        echo "chunkring-launch $* -> status $rc (expected $want) in $((SECONDS - start)) s" | tee -a "$logs/$name.log"
        # A live MPS process (not a zombie left for init to reap) would mean the daemon outlived the job.
        ps -eo stat=,pid=,comm= | awk '$1 !~ /^Z/ && $3 ~ /nvidia-cuda-mps/ {print; found=1} END {exit !found}' &&
            { echo "an MPS daemon outlived the job"; status=1; }
        [ "$rc" = "$want" ] || status=1
    }
    launch 0 stress stress iterations=100 --json "$results/${CHUNKRING_COMMIT}-launch-stress-${ranks}rank-mps.json"
    launch 0 chaos-delay stress --config chaos chaos=delay --json "$results/${CHUNKRING_COMMIT}-launch-chaos-delay-${ranks}rank-mps.json"
    launch 5 chaos-kill stress --config chaos
    chunkring-launch doctor 2>&1 | tee "$logs/doctor.log" || status=1
}
for part in "${parts[@]}"; do
    case $part in *_mps | *_mps_*) mps_up;; *) mps_down;; esac  # the launcher starts its own daemon
    "$part"
done
mps_down
# The device machine returns at most 8 files: send one archive of the summaries and the combined log.
if [ -n "${OUT:-}" ]; then
    cat "$logs"/*.log > "$results/suite.log"
    tar -C "$results" -czf "$OUT/gpu_results.tgz" .
fi
exit $status
