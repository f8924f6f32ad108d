"""The pool of incremental expert blocks at one rank (docs/PROTOCOL.md, "Incremental expert blocks";
device side: device/include/chunkring/moe/blocks.cuh).

With ``MoEConfig.waves > 1`` the consumer's pull (``moe_pull_blocks``) writes each (token, k) row of a
local expert straight into a block of ``block_m`` rows of that expert in this pool, and seals each block
once its rows landed; ``waves`` fixed launches of expert work (:meth:`chunkring.moe._engine.experts.ExpertCompute.
wave`) each claim the blocks sealed by then. Every size here depends only on the layer's configuration,
never on a call's routing, so the calls stay graph-capturable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chunkring.moe._engine.descriptors import POOL_FIELDS, descriptor_tensor
from chunkring.moe.gemm import padded_rows_bound
from chunkring.ring.spec import FP8_SCALE_BLOCK

__all__ = ["HEADER_WORDS", "BlockPool", "PoolShape", "pool_shape"]

#: moe/blocks.cuh ``kHeader``: the counter words before the per-expert and per-block arrays.
HEADER_WORDS = 8


@dataclass(frozen=True)
class PoolShape:
    """Sizes of one rank's pool: ``experts`` (E, local), ``blocks_per_expert`` (J = ceil(R / bm), R = W·N·K:
    the most blocks one expert can fill), ``blocks`` (P = padded_rows_bound / bm: the most blocks all experts
    together can allocate, tight), ``block_m`` (bm), ``choices`` (W·N·K: the pull's per-choice scratch)."""

    experts: int
    blocks_per_expert: int
    blocks: int
    block_m: int
    choices: int

    @property
    def rows(self) -> int:
        """Pool rows: P · bm (the batch plan's capacity: the same bound)."""
        return self.blocks * self.block_m

    @property
    def words(self) -> int:
        """u32 words of moe/blocks.cuh's layout: the header, reserve[E], block_of[E·J], then landed,
        state, expert_of and wave_ids, P each."""
        return HEADER_WORDS + self.experts * (1 + self.blocks_per_expert) + 4 * self.blocks


def pool_shape(max_tokens_per_rank: int, topk: int, world_size: int, experts_per_rank: int,
               block_m: int) -> PoolShape:
    """The pool's sizes (arguments checked as :func:`padded_rows_bound` checks them)."""
    padded = padded_rows_bound(max_tokens_per_rank, topk, world_size, experts_per_rank, block_m)
    choices = world_size * max_tokens_per_rank * topk
    return PoolShape(experts=experts_per_rank, blocks_per_expert=math.ceil(choices / block_m),
                     blocks=padded // block_m, block_m=block_m, choices=choices)


class BlockPool:
    """The pool's device buffers for one layer at one rank (allocated once, reused by every call).

    ``words`` int32 [shape.words] (u32 words; zeroed before each call by :meth:`reset`); ``pos`` int32
    [W·N·K]: the pull's pool row of each choice between its two passes; per pool row: ``x`` (uint8
    [rows, row bytes]: FP8 or bf16 bytes), ``sf`` fp32 [rows, H/128] (row-major, as published; FP8 only),
    ``src``, ``token``, ``k`` int32 and ``weight`` fp32 [rows]. The rows are never zeroed: a stale row is
    never read, because no block is sealed before its rows of this call landed. ``desc``: the ``PoolDesc``
    the kernels take (:mod:`chunkring.moe._engine.descriptors`), built once: the buffers are never reallocated.
    """

    def __init__(self, shape: PoolShape, hidden: int, fp8: bool, device: torch.device | str) -> None:
        self.shape = shape
        rows = shape.rows
        row_bytes, sf_per_row = (hidden, hidden // FP8_SCALE_BLOCK) if fp8 else (2 * hidden, 0)
        self.words = torch.zeros(shape.words, dtype=torch.int32, device=device)
        self.pos = torch.empty(shape.choices, dtype=torch.int32, device=device)
        self.x = torch.empty((rows, row_bytes), dtype=torch.uint8, device=device)
        self.sf = torch.empty((rows, sf_per_row), dtype=torch.float32, device=device)
        self.src = torch.empty(rows, dtype=torch.int32, device=device)
        self.token = torch.empty(rows, dtype=torch.int32, device=device)
        self.k = torch.empty(rows, dtype=torch.int32, device=device)
        self.weight = torch.empty(rows, dtype=torch.float32, device=device)
        self.desc = descriptor_tensor(POOL_FIELDS, {
            "experts": shape.experts, "blocks_per_expert": shape.blocks_per_expert, "blocks": shape.blocks,
            "block_m": shape.block_m, "row_bytes": row_bytes, "sf_per_row": sf_per_row, "words": self.words,
            "pos": self.pos, "x": self.x, "sf": self.sf, "src": self.src, "token": self.token, "k": self.k,
            "weight": self.weight}, device)

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool's buffers."""
        return sum(t.numel() * t.element_size()
                   for t in (self.words, self.pos, self.x, self.sf, self.src, self.token, self.k, self.weight))

    def reset(self) -> None:
        """Zero every word (reservations, allocations, landings, states, counters) on the current stream:
        a memset, graph-capturable; stream-ordered after the previous call's last wave on that stream."""
        self.words.zero_()
