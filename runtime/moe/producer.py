"""The streamed layer's producers: router GEMM -> TopK -> FP8 quantisation of the rows, in torch,
ready to be published as a chunk (:func:`chunkring.publish_chunk`).

These run on the GPU inside a call, so they never read a device value on the host (no checks that
would need one: a non-finite activation gives a non-finite scale, which the output shows).
"""

from __future__ import annotations

import torch

from chunkring.ring.spec import FP8_SCALE_BLOCK

__all__ = ["E4M3_MAX", "quantize_rows_fp8", "route"]

#: Largest finite float8_e4m3fn value (e4m3fn has no infinity; the all-ones code is NaN).
E4M3_MAX = 448.0


def route(hidden: torch.Tensor, router_weight: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``hidden`` bf16 [n, H] with ``router_weight`` bf16 [E, H].

    Returns topk_idx int32 [n, K] and topk_weights float32 [n, K]: the K largest softmax scores,
    renormalised to sum to 1 per token. The logits are an fp32 GEMM, so a token's choice does not depend
    on which other tokens share its chunk beyond fp32 rounding.
    """
    logits = hidden.float() @ router_weight.float().T
    scores, idx = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return idx.to(torch.int32), scores / scores.sum(dim=-1, keepdim=True)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 or bfloat16 [N, H] (H a multiple of 128) -> x_fp8 float8_e4m3fn [N, H], x_sf float32
    [N, H / 128] with x ≈ x_fp8 * x_sf: each block's absmax maps to 448; a zero block gets scale 1
    (and one whose absmax / 448 underflows fp32 is treated alike)."""
    n, h = x.shape
    blocks = x.to(torch.float32).reshape(n, h // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
    scale = blocks.abs().amax(dim=-1) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # fp32 division can land the absmax element a hair above 448 (448.00003). torch's CPU cast saturates,
    # but a non-saturating cast (cvt without .satfinite) gives NaN; the clamp keeps the result
    # independent of that policy.
    scaled = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).reshape(n, h), scale
