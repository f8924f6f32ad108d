"""The layer's fused producer: router GEMM -> one kernel per chunk (device/kernels/moe_produce.cu) that routes
(top-k), quantises (FP8 payload) and publishes. What it computes equals :mod:`chunkring.moe.routing`'s torch
functions, which it is tested against.

These run on the GPU inside a call, so they never read a device value on the host (no checks that
would need one: a non-finite activation gives a non-finite scale, which the output shows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.kernel_args import ProduceChunkArgs

if TYPE_CHECKING:
    from chunkring.jit.launch import KernelLibrary
    from chunkring.ring.ring import Ring

__all__ = ["PRODUCE_MAX_BLOCKS", "enqueue_produce", "produce_grid", "produce_grid_limit"]


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
    """Publish ``hidden`` bf16 [n, H] as the ring's next chunk, routed by ``logits`` fp32 [n, E] (the router GEMM's
    output), in one kernel: top-k with renormalised softmax weights, FP8 quantisation (FP8 payload) and the publish
    (device/kernels/moe_produce.cu; what it computes equals :func:`chunkring.moe.routing.route` and
    :func:`~chunkring.moe.routing.quantize_rows_fp8` up to a few ulps of the weights). ``arrivals`` int32 [1], zero (the
    kernel leaves it zero; zero it again after a failed call). Arguments are the layer's, checked at its boundary;
    ``valid_tokens`` / ``batch_rows`` as in :func:`chunkring.publish_chunk`; ``max_blocks`` as
    :func:`produce_grid_limit` gives it."""
    rows = hidden.shape[0]
    grid = produce_grid(rows, hidden.shape[1], max_blocks)
    kernels.launch("moe_produce_chunk", args=ProduceChunkArgs(
        desc=ring.desc, logits=logits, hidden=hidden, num_experts=logits.shape[1], n_tokens=rows,
        token_base=token_base, end_of_stream=int(end_of_stream), valid_tokens=valid_tokens,
        batch_rows=0 if batch_rows is None else batch_rows, arrivals=arrivals if grid > 1 else None),
        grid=grid, block=_PRODUCE_BLOCK, stream=stream)
