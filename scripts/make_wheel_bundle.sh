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
# sgl-deep-gemm is DeepGEMM (SM90 FP8 grouped GEMMs, the expert engine, and its SM90 MegaMoE, the benchmark
# anchor: benchmarks/probe_deepgemm.py, docs/notes_deepgemm.md) as a prebuilt _C.so built against CUDA 13; it
# loads through apache-tvm-ffi (abi3 wheel; needs typing-extensions, which the host has). sgl-deep-gemm is pinned
# to 0.1.5 because its _C.so is the newest build whose torch symbols all resolve in the host's torch
# 2.11.0+cu130: 0.1.5.post3, 0.1.6, 0.1.7 and 0.2.x each miss 1-8 torch 2.11 symbols and fail at import.
# apache-tvm-ffi is pinned to 0.1.11 because sgl-deep-gemm 0.1.5 requires exactly that version.
# transformers (the hf extra: tests/gpu/test_hf_dropin_model.py, chunkring.integrations.transformers) with what
# `import transformers.models.qwen3_moe.modeling_qwen3_moe` (and deepseek_v3, and building and running their
# models) needs beyond the host's torch (filelock, fsspec, jinja2, networkx, sympy, typing-extensions),
# numpy and pytest (packaging) - checked by importing with only these on the path: huggingface-hub (with
# httpx2 -> httpcore2 -> h11, idna, truststore; tqdm, pyyaml), regex, safetensors. tokenizers, typer, click
# and hf-xet are declared dependencies but not imported on this path, so they are left out (--no-deps).
# regex and pyyaml are cp312 builds, safetensors abi3; the rest are pure Python.
wheels=(nvshmem4py-cu13==0.4.1 pytest-mpi==0.6 pytest-timeout==2.4.0
        sgl-deep-gemm==0.1.5 apache-tvm-ffi==0.1.11
        transformers==5.24.0 huggingface-hub==2.4.0 safetensors==0.8.0 regex==2026.11.19 pyyaml==6.0.4
        tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 idna==3.20 truststore==0.10.5)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "${wheels[@]}"
ls -l "$dest"
