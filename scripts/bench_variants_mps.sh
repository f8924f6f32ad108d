#!/usr/bin/env bash
# Which key sets of `chunkring-launch --np 4 --mps bench` complete, one run each (a device call; carry .whl and
# .carry): scripts/bench_variants_mps.sh "tokens=512 chunks=32 trace=" ... ; summary and each run's output under $OUT.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CHUNKRING_CACHE_DIR=/tmp/chunkring-cache CHUNKRING_TIMEOUT_S=${CHUNKRING_TIMEOUT_S:-20}
mkdir -p $CHUNKRING_CACHE_DIR && [ -f .carry/cache.tgz ] && tar -C $CHUNKRING_CACHE_DIR -xzf .carry/cache.tgz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
python3 scripts/build_kernels.py >/dev/null 2>&1
i=0
for v in "$@"; do
    i=$((i + 1)); mkdir -p "$OUT/v$i" && cd "$OUT/v$i"
    start=$SECONDS
    # shellcheck disable=SC2086
    timeout 170 chunkring-launch --np 4 --mps bench $v iterations=2 warmup=1 rotate=1 > out.txt 2>&1
    echo "variant $i [$v]: status $? in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -5 out.txt
    for d in /tmp/chunkring-job-*; do [ -d "$d" ] && cp -r "$d" . && rm -rf "$d"; done
    rm -f ./*.json.tmp; cd - >/dev/null
done
