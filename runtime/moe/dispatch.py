"""The MoE consumer's expert work of one call, on fixed shapes: plan the rows a call pulled into expert
groups (one group per local expert over every chunk of every source: cross-chunk groups sealed by the
end of every stream, RFC dispatch option 2), run L1 -> SwiGLU -> L2 on them, and weight the results by
``topk_weights``.

:func:`plan_experts` runs inside the layer. Every shape here depends only on the layer's configuration,
never on token counts or routing, and nothing reads a device value on the host: the work needs no host
synchronisation and can be captured in a CUDA graph. It runs on CPU tensors too, where the tests check it
against the host planner (:mod:`chunkring.testing.plan`) row for row; :mod:`chunkring.testing.reference`
holds the torch reference of the row kernels that run on the plan.

Inputs (written by the ``moe_pull`` kernel, device/kernels/moe_stream.cu), for W source ranks, N rows
per source (``max_tokens_per_rank``), K choices, every row at its token index:
    stage_idx int32 [W, N, K], stage_w float32 [W, N, K]: the routing of every pulled row; rows no
    chunk brought hold -1 (the layer refills them before each call), so they are planned nowhere;
    stage_x [W, N, H] (float8_e4m3fn or bfloat16) and stage_sf float32 [W, N, H/128]: the payload of
    the rows with a choice on this rank (other rows: stale, never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkring.errors import ChunkringUsageError

__all__ = ["ExpertPlan", "padded_rows_bound", "plan_experts"]

@dataclass(frozen=True, eq=False)
class ExpertPlan:
    """Where a call's rows go at this rank, as fixed-shape device tensors (P = ``capacity``, sized by
    :func:`chunkring.testing.plan.padded_rows_bound`).

    expert_offsets int64 [E_local + 1]: group e is padded rows [offsets[e], offsets[e + 1]), a multiple
    of ``block_m`` each; rows from offsets[-1] to P are unused.   counts int64 [E_local]: real rows.
    Per padded row [P]: src_rank, token_index (the row's index at its source and in the stage), topk_pos
    (int64, -1 on padding rows) and weight (float32, 0 on padding rows).
    """

    expert_offsets: torch.Tensor
    counts: torch.Tensor
    src_rank: torch.Tensor
    topk_pos: torch.Tensor
    token_index: torch.Tensor
    weight: torch.Tensor

    @property
    def real(self) -> torch.Tensor:
        """bool [P]: rows that carry a (token, k) choice."""
        return self.src_rank >= 0


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


def plan_experts(stage_idx: torch.Tensor, stage_w: torch.Tensor, *, first_expert: int, experts_per_rank: int,
                 block_m: int, capacity: int) -> ExpertPlan:
    """Group the pulled (source, row, k) choices routed to experts [first_expert, first_expert + E_local)
    by local expert, in (source, row, k) order within a group, each group padded to ``block_m`` rows.

    A choice outside this rank's experts - another rank's expert, a masked -1, or any other value - is
    not planned here; every rank applies the same rule, so an out-of-range index is dropped everywhere
    (the layer's documented rule for indices outside [-1, num_experts): they count as masked).
    """
    W, T, K = stage_idx.shape
    E = experts_per_rank
    device = stage_idx.device
    M = W * T * K
    local = stage_idx.to(torch.int64) - first_expert
    mine = (local >= 0) & (local < E)
    # Group key per choice, in flattened (source, row, k) order; E = "not for this rank".
    key = torch.where(mine, local, E).reshape(-1)
    counts_all = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts_all.scatter_add_(0, key, torch.ones(M, dtype=torch.int64, device=device))
    counts = counts_all[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts_all, 0) - counts_all  # unpadded starts, "not mine" last

    # The stable sort keeps (source, row, k) order inside each group: the order rule of moe_plan.
    sorted_key, choice = torch.sort(key, stable=True)
    rank_in_group = torch.arange(M, device=device) - group_start[sorted_key]
    dest = torch.where(sorted_key < E, offsets[sorted_key.clamp(max=E - 1)] + rank_in_group, capacity)
    # Row P is a dump for the choices not planned here; dropped below.
    row_choice = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)
    row_choice.scatter_(0, dest, choice)
    row_choice = row_choice[:capacity]

    real = row_choice >= 0
    safe = row_choice.clamp(min=0)
    src = safe // (T * K)
    row = safe // K % T  # a row's index in the stage is its token index
    pad = torch.full_like(row_choice, -1)
    return ExpertPlan(
        expert_offsets=offsets,
        counts=counts,
        src_rank=torch.where(real, src, pad),
        topk_pos=torch.where(real, safe % K, pad),
        token_index=torch.where(real, row, pad),
        weight=torch.where(real, stage_w.reshape(-1)[safe], torch.zeros((), device=device)),
    )
