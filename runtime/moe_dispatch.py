"""The MoE consumer's expert work of one call, on fixed shapes: plan the rows a call pulled into expert
groups (one group per local expert over every chunk of every source: cross-chunk groups sealed by the
end of every stream, RFC dispatch option 2), run L1 -> SwiGLU -> L2 on them, and weight the results by
``topk_weights``.

:func:`plan_experts` runs inside the layer. Every shape here depends only on the layer's configuration,
never on token counts or routing, and nothing reads a device value on the host: the work needs no host
synchronisation and can be captured in a CUDA graph. It runs on CPU tensors too, where the tests check it
against the host planner (:mod:`chunkring.moe_plan`) row for row. :func:`gather_rows` and
:func:`expert_forward` are the torch reference of the layer's row kernels (``moe_gather_rows``,
``moe_swiglu`` and the weighting in ``moe_combine_push``, device/kernels/moe_stream.cu), which skip the
padding rows these spend full passes on; tests/gpu/test_moe_rows.py holds the kernels to them.

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
import torch.nn.functional as F

from .ring_spec import FP8_SCALE_BLOCK

__all__ = ["ExpertPlan", "expert_forward", "plan_experts"]

@dataclass(frozen=True, eq=False)
class ExpertPlan:
    """Where a call's rows go at this rank, as fixed-shape device tensors (P = ``capacity``, sized by
    :func:`chunkring.moe_plan.padded_rows_bound`).

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


def gather_rows(plan: ExpertPlan, stage_x: torch.Tensor, stage_sf: torch.Tensor | None) -> torch.Tensor:
    """bfloat16 [P, H]: each planned row's activations (FP8 rows dequantised with their per-128 scales).
    Padding rows hold whatever stage row 0 holds, maybe stale NaN bytes: no GEMM mixes rows, so they can
    reach only their own (padding) results, which the combine push skips. No masking pass is spent on them."""
    W, T, H = stage_x.shape
    flat = plan.src_rank.clamp(min=0) * T + plan.token_index.clamp(min=0)
    rows = stage_x.reshape(W * T, H)[flat].to(torch.float32)
    if stage_sf is not None:
        scales = stage_sf.reshape(W * T, H // FP8_SCALE_BLOCK)[flat]
        rows = (rows.reshape(-1, H // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK) * scales.unsqueeze(-1)).reshape(-1, H)
    return rows.to(torch.bfloat16)


def expert_forward(plan: ExpertPlan, rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """float32 [P, H]: ``weight * w2[e] @ (silu(gate) * up)``, ``[gate, up] = w13[e] @ row``, per planned row.
    Padding rows (and rows past ``offsets[-1]``, which the GEMMs leave unwritten) hold garbage, maybe NaN:
    the combine push skips them (``src_rank`` -1), so no pass is spent zeroing them.

    rows bfloat16 [P, H];  w13 bfloat16 [E_local, 2I, H] (gate rows first);  w2 bfloat16 [E_local, H, I].
    The GEMMs are ``torch._grouped_mm`` with the plan's device-side group ends: one launch per layer for
    every expert, shapes fixed, no host synchronisation (CUTLASS grouped GEMM on sm90, bf16 in, fp32
    accumulate). FP8 payloads are dequantised to bf16 first: correctness first; an FP8 grouped GEMM with
    per-128 scales is the faster path this leaves for later.
    """
    ends = plan.expert_offsets[1:].to(torch.int32)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    inter = w13.shape[1] // 2
    act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(torch.bfloat16)
    out = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends).float()
    return out.mul_(plan.weight[:, None])
