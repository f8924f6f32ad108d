#!/usr/bin/env bash
# Prepare the offline wheel bundle for a GPU host without network (CPython 3.12, x86-64 manylinux):
# the packages chunkring needs that the host's image lacks. Run where PyPI is reachable.
#   scripts/make_wheel_bundle.sh [DEST]       (DEST defaults to .whl, which git ignores)
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
# nvshmem4py is pure glue over the NVSHMEM host library the host already has (nvidia-nvshmem-cu13 3.4.5,
# pinned by its torch); pytest-mpi adds the `mpi` marker to the host's pytest; pytest-timeout gives every
# GPU test a time limit, so a hang fails one test instead of eating the device budget.
wheels=(nvshmem4py-cu13==0.4.1 pytest-mpi==0.6 pytest-timeout==2.4.0)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "${wheels[@]}"
ls -l "$dest"
