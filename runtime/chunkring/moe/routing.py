"""Routing and row quantisation, as the layer's producers compute them: the router GEMM (:func:`router_logits`), top-k
(:func:`route`) and FP8 quantisation of rows with one scale per 1x128 (:func:`quantize_rows_fp8`). The public seam for
callers that route a batch themselves (:meth:`chunkring.MoELayer.run`, the transformers drop-in, the benchmarks): the
layer's fused producer (its engine) computes the same and is tested against these.

None reads a device value on the host, so each captures into a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chunkring.ring.spec import E4M3_MAX, FP8_SCALE_BLOCK

if TYPE_CHECKING:
    from chunkring.jit.launch import KernelLibrary

__all__ = ["E4M3_MAX", "ROUTER_MAX_SLICES", "ROUTER_SLICE", "ROUTER_TILE", "quantize_rows_fp8", "route",
           "router_logits", "router_slices"]

#: moe_produce.cu's router tiling: each warp of a block sums a slice of at least this many hidden columns, and a
#: block has at most ROUTER_MAX_SLICES warps.
ROUTER_SLICE = 512
ROUTER_MAX_SLICES = 16
#: Tokens x experts a block of moe_router_logits computes: its launch has one block per tile.
ROUTER_TILE = (16, 32)


def router_slices(hidden: int) -> int:
    """Warps of ``moe_router_logits``' block for hidden size ``hidden``: the fixed split of each logit's sum.
    It depends on the hidden size alone, so a token's logits never depend on how many tokens share the GEMM."""
    return min(ROUTER_MAX_SLICES, -(-hidden // ROUTER_SLICE))


def router_logits(hidden: torch.Tensor, router_weight: torch.Tensor, *,
                  kernels: KernelLibrary | None = None) -> torch.Tensor:
    """The router GEMM: ``hidden`` bf16 [n, H] x ``router_weight`` bf16 [E, H] -> fp32 logits [n, E].

    On the GPU, ``moe_router_logits`` (device/kernels/moe_produce.cu) on the tensor cores: bf16 products
    (exact in fp32) summed in fp32 in one order fixed by H alone, so a token's logits are the same bits
    whether it is routed alone, in a chunk or in the whole batch - a streamed call routes exactly as a
    batch-ready one (a cuBLAS GEMM picks its kernel, and so its order of sums, by the token count).
    ``kernels``: the library holding the kernel (None: this process's, :func:`chunkring.current`). On the
    CPU, an fp32 GEMM (tests of the host logic)."""
    if not hidden.is_cuda:
        return hidden.float() @ router_weight.float().T
    if kernels is None:
        from chunkring.bringup import current
        from chunkring.jit import library_for

        kernels = library_for(current(), "moe_produce")
    n, H = hidden.shape
    E = router_weight.shape[0]
    logits = torch.empty((n, E), dtype=torch.float32, device=hidden.device)
    if n:
        tiles = -(-n // ROUTER_TILE[0]) * -(-E // ROUTER_TILE[1])
        kernels.launch("moe_router_logits", hidden=hidden, router=router_weight, logits=logits, n=n, num_experts=E,
                       hidden_size=H, grid=tiles, block=32 * router_slices(H),
                       stream=torch.cuda.current_stream(hidden.device))
    return logits


def route(hidden: torch.Tensor, router_weight: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``hidden`` bf16 [n, H] with ``router_weight`` bf16 [E, H].

    Returns topk_idx int32 [n, K] and topk_weights float32 [n, K]: the K largest softmax scores,
    renormalised to sum to 1 per token. The logits are :func:`router_logits` (fp32 sums, batch-invariant on
    the GPU), so a token's choice does not depend on which other tokens share its chunk.
    """
    logits = router_logits(hidden, router_weight)
    scores, idx = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return idx.to(torch.int32), scores / scores.sum(dim=-1, keepdim=True)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 or bfloat16 [N, H] (H a multiple of 128) -> x_fp8 float8_e4m3fn [N, H], x_sf float32
    [N, H / 128] with x ≈ x_fp8 * x_sf: each block's absmax maps to 448; a zero block gets scale 1
    (and one whose absmax / 448 underflows fp32 is treated alike)."""
    n, h = x.shape
    blocks = x.to(torch.float32).reshape(n, h // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # A tensor divisor, not a Python number: torch's CUDA division by a CPU scalar multiplies by its
    # reciprocal, an ulp off the quotient at times; this is an IEEE division on every device, as the fused
    # producer's (device/kernels/moe_produce.cu). Filled on the device (full_like), not copied from the host:
    # a host-to-device copy is illegal inside a CUDA graph capture, where serving code quantises too.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # fp32 division can land the absmax element a hair above 448 (448.00003). torch's CPU cast saturates,
    # but a non-saturating cast (cvt without .satfinite) gives NaN; the clamp keeps the result
    # independent of that policy.
    scaled = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).reshape(n, h), scale
