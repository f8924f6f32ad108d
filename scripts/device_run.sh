#!/usr/bin/env bash
# One device call (the device tool): scripts/gpu_suite.sh parts with results under /tmp/res, packed into $OUT with
# DeepGEMM's and the kernels' JIT cache; a cache.tgz from an earlier call in .carry/ is unpacked first. Carry .whl
# (scripts/make_wheel_bundle.sh) and .carry.
#   scripts/device_run.sh COMMIT TREE_MODIFIED SUITE_LIMIT_S PART...   (TREE_MODIFIED: 1 if git status is not clean)
set -uo pipefail
commit=$1 modified=$2 limit=$3; shift 3
export CHUNKRING_COMMIT=$commit CHUNKRING_TREE_MODIFIED=$modified
export RESULTS=/tmp/res/gpu BENCH_RESULTS=/tmp/res/bench LOGS=/tmp/res/logs CHUNKRING_CACHE_DIR=/tmp/chunkring-cache
# A machine may come with an earlier call's /tmp: pack only this call's results.
rm -rf /tmp/res
mkdir -p "$RESULTS" "$BENCH_RESULTS" "$LOGS" "$CHUNKRING_CACHE_DIR"
[ -f .carry/cache.tgz ] && tar -C "$CHUNKRING_CACHE_DIR" -xzf .carry/cache.tgz
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$LOGS/nvidia-smi.log"
start=$SECONDS
timeout "$limit" scripts/gpu_suite.sh .whl 4 "$@"
rc=$?
echo "gpu_suite exit $rc after $((SECONDS - start)) s" | tee -a "$LOGS/driver.log"
# A suite that timeout cut short leaves its MPS daemon (private pipe directory, so `quit` cannot reach it from
# here): end it by name. The device machine is this session's alone.
pkill -f nvidia-cuda-mps 2>/dev/null
# A failed launch leaves each rank's diagnostic in its job directory (chunkring-launch names it): keep them.
for job in /tmp/chunkring-job-*; do
    [ -d "$job" ] || continue
    mkdir -p "$LOGS/jobs/${job##*/}" && cp "$job"/rank*.txt "$job"/first_failure "$LOGS/jobs/${job##*/}/" 2>/dev/null
done
tar -C /tmp/res -czf "$OUT/res.tgz" .
tar -C "$CHUNKRING_CACHE_DIR" -czf "$OUT/cache.tgz" --exclude='*.lock' . 2>/dev/null
ls -la "$OUT"
# The call's status is the suite's (124: cut by the limit), not the packing's.
exit $rc
