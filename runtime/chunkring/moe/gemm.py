"""The expert GEMM engine the FP8 payload runs on: DeepGEMM's m-grouped FP8 GEMMs (sgl-deep-gemm), loaded once
(:func:`load_deep_gemm`); the row alignment of its contiguous layout (:data:`GROUP_ALIGN`), which the layer's plan
follows; and the most padded rows one call's plan can hold (:func:`padded_rows_bound`), which sizes the consumer's
buffers. The plan itself is built on the device (``moe_plan_count`` / ``moe_plan_scatter`` in
device/kernels/moe_experts.cu, driven by the engine): every pulled (source, token, k) choice routed to one of a rank's
experts takes a row of its expert's group, each group padded to a multiple of ``block_m`` rows;
:func:`chunkring.testing.plan.plan_batch` is its host reference. Public: ``chunkring-launch doctor``, the benchmarks
and the references use it."""

from __future__ import annotations

import os
from typing import Any

from chunkring.env import cache_dir
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

__all__ = ["GROUP_ALIGN", "load_deep_gemm", "padded_rows_bound"]

#: Rows each expert group is padded to: DeepGEMM's M alignment for the contiguous layout (checked
#: against the library when it loads). The bf16 path plans alike, so both paths share one plan.
GROUP_ALIGN = 128


def load_deep_gemm() -> Any:
    """Import DeepGEMM, with its JIT cache under chunkring's (``CHUNKRING_CACHE_DIR``/deep_gemm) unless
    ``DG_JIT_CACHE_DIR`` says otherwise. Raises ``ChunkringRuntimeError`` saying what to install."""
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(cache_dir() / "deep_gemm"))
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or a build that does not match this torch
        raise ChunkringRuntimeError(
            "the FP8 expert GEMMs need DeepGEMM: pip install 'chunkring[fp8]' (sgl-deep-gemm 0.1.5 with "
            f"apache-tvm-ffi 0.1.11 for torch 2.11 and CUDA 13; README.md, 'Requirements'): {exc}") from exc
    align = deep_gemm.get_mk_alignment_for_contiguous_layout()
    if align != GROUP_ALIGN:
        raise ChunkringRuntimeError(f"DeepGEMM pads contiguous groups to {align} rows; chunkring plans for "
                                    f"{GROUP_ALIGN}")
    return deep_gemm


def padded_rows_bound(rows_per_source: int, topk: int, world_size: int, experts_per_rank: int, block_m: int) -> int:
    """The most padded rows one call's plan can produce at one destination (the size of the consumer's
    fixed device buffers), when each source brings at most ``rows_per_source`` rows (the layer passes
    ``max_tokens_per_rank``).

    Derivation: at most ``R = W * rows_per_source * K`` real rows reach one destination (K, not
    min(K, E_local): nothing forbids a row from naming one expert twice, and each (token, k) is its own
    row). A group of ``c >= 1`` rows pads to ``block_m * ceil(c / block_m)`` and an empty group to 0. With
    ``g`` non-empty groups the block count is ``sum(1 + (c_e - 1) // block_m) <= g + (R - g) // block_m``,
    which does not decrease with ``g``; so take ``g = min(E_local, R)``. It is reached (``g - 1`` groups of
    one row, one group of the rest), so the bound is tight:  ``block_m * (g + (R - g) // block_m)``.
    """
    for name, value in (("rows_per_source", rows_per_source), ("topk", topk), ("world_size", world_size),
                        ("experts_per_rank", experts_per_rank), ("block_m", block_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ChunkringUsageError(f"must be a positive int, got {value!r}", field=name)
    real = world_size * rows_per_source * topk
    groups = min(experts_per_rank, real)
    return block_m * (groups + (real - groups) // block_m)
