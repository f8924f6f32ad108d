"""The layer's producers: router GEMM -> TopK -> FP8 quantisation of the rows -> publish.

:func:`enqueue_produce` is what a call runs: the router GEMM in torch, then one fused kernel per chunk
(device/kernels/moe_produce.cu) that routes, quantises and publishes. :func:`route` and
:func:`quantize_rows_fp8` compute the same in torch: the reference the kernel is tested against, and the
producers of callers that route a batch themselves (:meth:`chunkring.MoELayer.run`).

These run on the GPU inside a call, so they never read a device value on the host (no checks that
would need one: a non-finite activation gives a non-finite scale, which the output shows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.ring.spec import E4M3_MAX, FP8_SCALE_BLOCK

if TYPE_CHECKING:
    from chunkring.jit.launch import KernelLibrary
    from chunkring.ring.ring import Ring

__all__ = ["E4M3_MAX", "ROUTER_MAX_SLICES", "ROUTER_SLICE", "ROUTER_TILE", "enqueue_produce", "produce_grid",
           "produce_grid_limit", "quantize_rows_fp8", "route", "router_logits", "router_slices"]

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


#: Elements of ``hidden`` one block of the fused producer takes (about 4 warp tasks of 128 columns per warp of
#: a 256-thread block: each task is a chain of dependent memory latencies, so a chunk's kernel time follows
#: the tasks per warp, not the bytes), at most one block per row and PRODUCE_MAX_BLOCKS in all: every block
#: also waits for the slot and arrives, so a grid larger than the SMs hold at once costs more than it
#: spreads. On a 32-SM producer partition of the H200, flash shape, a 128-token chunk took 43 us at 16 blocks
#: and 35 us at 128, a 1,024-token chunk 96 us at 128 blocks and 155 us at 1,024 (docs/PERFORMANCE.md).
PRODUCE_ELEMENTS_PER_BLOCK = 4096
PRODUCE_MAX_BLOCKS = 128
_PRODUCE_BLOCK = 256


def produce_grid(rows: int, hidden: int, max_blocks: int = PRODUCE_MAX_BLOCKS) -> int:
    """Blocks of the fused producer (``moe_produce_chunk``) for a chunk of ``rows`` x ``hidden``, at most
    ``max_blocks`` (:func:`produce_grid_limit`)."""
    return max(1, min(-(-rows * hidden // PRODUCE_ELEMENTS_PER_BLOCK), rows, max_blocks, PRODUCE_MAX_BLOCKS))


def produce_grid_limit(sms: int, gpu_ranks: int, consumer_blocks: int = 0) -> int:
    """The most blocks a fused producer may have on ``sms`` SMs that ``gpu_ranks`` ranks share, each running
    one like it, beside a consumer of ``consumer_blocks`` blocks spinning on the same SMs (0: the consumers
    have SMs of their own, a partition). Every producer block waits for the slot's acks, spinning, and a
    consumer takes the sources' chunks in a fixed order, so where ranks share the GPU every rank's spinning
    blocks must be resident at once however the GPU places them, with room left for their other kernels
    (the router GEMM): one SM per spinning block within the rank's share of ``sms``, one SM of the share
    left over. One rank per GPU: its own kernels are stream-ordered, and the grid stays as measured
    (docs/PROTOCOL.md, "Progress" 8)."""
    if gpu_ranks == 1:
        return PRODUCE_MAX_BLOCKS
    free = sms // gpu_ranks - 1 - consumer_blocks
    if free < 1:
        raise ChunkringUsageError(f"{gpu_ranks} ranks on {sms} SMs, each with a consumer of {consumer_blocks} "
                                  "blocks beside its producer, leave no SM to the producer", field="gpu_ranks")
    return min(PRODUCE_MAX_BLOCKS, free)


def enqueue_produce(ring: Ring, kernels: KernelLibrary, logits: torch.Tensor, hidden: torch.Tensor,
                    token_base: int, end_of_stream: bool, valid_tokens: torch.Tensor | None, batch_rows: int | None,
                    arrivals: torch.Tensor, stream: torch.cuda.Stream, max_blocks: int = PRODUCE_MAX_BLOCKS) -> None:
    """Publish ``hidden`` bf16 [n, H] as the ring's next chunk, routed by ``logits`` fp32 [n, E] (the router
    GEMM's output), in one kernel: top-k with renormalised softmax weights, FP8 quantisation (FP8 payload)
    and the publish (device/kernels/moe_produce.cu; what it computes equals :func:`route` and
    :func:`quantize_rows_fp8` up to a few ulps of the weights). ``arrivals`` int32 [1], zero (the kernel
    leaves it zero; zero it again after a failed call). Arguments are the layer's, checked at its boundary;
    ``valid_tokens`` / ``batch_rows`` as in :func:`chunkring.publish_chunk`; ``max_blocks`` as
    :func:`produce_grid_limit` gives it."""
    rows = hidden.shape[0]
    grid = produce_grid(rows, hidden.shape[1], max_blocks)
    kernels.launch("moe_produce_chunk", desc=ring.desc, logits=logits, hidden=hidden, num_experts=logits.shape[1],
                   n_tokens=rows, token_base=token_base, end_of_stream=int(end_of_stream), valid_tokens=valid_tokens,
                   batch_rows=0 if batch_rows is None else batch_rows, arrivals=arrivals if grid > 1 else None,
                   grid=grid, block=_PRODUCE_BLOCK, stream=stream)
