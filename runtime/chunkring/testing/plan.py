"""Host-side dispatch plan for the MoE layer: which (source, token, k) rows land where at one destination.

One plan per call: a destination rank takes every source's whole batch, gathers every (token, k) choice
routed to one of its local experts, groups the choices by local expert and pads each group up to a
multiple of the GEMM block ``block_m`` with marked padding rows (``-1`` indices, weight 0). Within a group
the order is fixed: source rank, then row, then ``k``; so a plan is a pure function of its inputs and two
runs agree bitwise. Masked choices (-1) are planned nowhere.

Everything here runs on the host, on CPU tensors, and checks its inputs before any work - including the
index values (every one in [-1, num_experts)), which a device kernel could not read without a
synchronisation; a bad input raises :class:`~chunkring.errors.ChunkringUsageError` naming the field.
:func:`plan_batch` is the reference the layer's device plan (``moe_plan_scatter`` in
device/kernels/moe_experts.cu) is tested against, group by group; the device plan places a group's rows in
any order (an atomic cursor), so the test compares each group's rows as a set.

Conventions (as in :mod:`chunkring.ring.layout`): ``topk_idx`` int32 [n, K], -1 = masked choice;
``topk_weights`` float32 [n, K]; rank ``d`` of ``W`` owns experts ``[d * E / W, (d + 1) * E / W)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe.gemm import padded_rows_bound

__all__ = ["DispatchPlan", "padded_rows_bound", "plan_batch"]

#: Marks a padding row in the int32/int64 row tensors of a :class:`DispatchPlan`.
PAD = -1


@dataclass(frozen=True, eq=False)  # eq on tensors is ambiguous; compare fields with torch.equal
class DispatchPlan:
    """Where one destination rank's rows go for one call.

    Rows are grouped by local expert; group ``e`` occupies padded rows
    ``[expert_offsets[e], expert_offsets[e + 1])``, its first ``counts[e]`` rows real, the rest padding.

    expert_offsets: int64 [E_local + 1], a multiple of ``block_m`` each; last = total padded rows P.
    counts:         int64 [E_local], real rows per local expert.
    Per padded row, [P] each (padding rows: -1, weight 0):
    src_rank int32, token_index int64 (row within its source's batch), topk_pos int32 (k), weight float32.
    dest_rank, experts_per_rank, block_m: what the plan was built for (global expert =
    dest_rank * experts_per_rank + local expert).
    """

    expert_offsets: torch.Tensor
    counts: torch.Tensor
    src_rank: torch.Tensor
    token_index: torch.Tensor
    topk_pos: torch.Tensor
    weight: torch.Tensor
    dest_rank: int
    experts_per_rank: int
    block_m: int

    def __post_init__(self) -> None:
        # Cheap structural checks only (no value scans): a plan is usually built by this module.
        e_local = self.experts_per_rank
        for name, dtype, length in (("expert_offsets", torch.int64, e_local + 1), ("counts", torch.int64, e_local)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (length,):
                raise ChunkringUsageError(f"need a {dtype} tensor of shape [{length}]", field=name)
        rows = int(self.expert_offsets[-1])
        for name, dtype in (("src_rank", torch.int32), ("token_index", torch.int64), ("topk_pos", torch.int32),
                            ("weight", torch.float32)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (rows,):
                raise ChunkringUsageError(f"need a {dtype} tensor of shape [{rows}] (expert_offsets[-1])",
                                          field=name)

    @property
    def num_real_rows(self) -> int:
        return int(self.counts.sum())

    @property
    def num_padded_rows(self) -> int:
        return int(self.expert_offsets[-1])

    def local_expert_of_rows(self) -> torch.Tensor:
        """int32 [P]: the local expert whose group holds each padded row (padding rows included)."""
        sizes = self.expert_offsets[1:] - self.expert_offsets[:-1]
        return torch.repeat_interleave(torch.arange(self.experts_per_rank, dtype=torch.int32), sizes)

    def entries(self) -> list[tuple[int, int, int, int]]:
        """Sorted real rows as ``(src_rank, token_index, topk_pos, global_expert)`` tuples."""
        real = self.src_rank >= 0
        expert = self.local_expert_of_rows()[real].to(torch.int64) + self.dest_rank * self.experts_per_rank
        columns = (self.src_rank[real].tolist(), self.token_index[real].tolist(), self.topk_pos[real].tolist(),
                   expert.tolist())
        return sorted(zip(*columns, strict=True))

    def __repr__(self) -> str:
        return (f"DispatchPlan(dest_rank={self.dest_rank}, experts_per_rank={self.experts_per_rank}, "
                f"block_m={self.block_m}, real_rows={self.num_real_rows}, padded_rows={self.num_padded_rows})")


def plan_batch(per_source_topk_idx: list, per_source_topk_weights: list, *, dest_rank: int, world_size: int,
               num_experts: int, block_m: int) -> DispatchPlan:
    """The plan of one call at ``dest_rank``, over every source's whole batch.

    per_source_topk_idx: ``world_size`` int32 [n_s, K] (one K for all); per_source_topk_weights:
    float32 [n_s, K]. Every input is checked before any planning work starts.
    """
    _check_int("world_size", world_size, low=1)
    _check_int("num_experts", num_experts, low=1)
    if num_experts % world_size:
        raise ChunkringUsageError(f"{num_experts} experts do not split evenly over {world_size} ranks",
                                  field="num_experts")
    _check_int("block_m", block_m, low=1)
    _check_int("dest_rank", dest_rank, low=0, high=world_size - 1)
    _check_per_source(per_source_topk_idx, per_source_topk_weights, world_size, num_experts)
    experts_per_rank = num_experts // world_size

    K = per_source_topk_idx[0].shape[1]
    # Flatten in (source, row, k) order: the stable sort by expert below keeps exactly this order
    # within each expert's group, which is the ordering rule of the module docstring.
    expert = torch.cat([idx.reshape(-1) for idx in per_source_topk_idx]).to(torch.int64)
    weight = torch.cat([w.reshape(-1) for w in per_source_topk_weights])
    pairs = torch.tensor([idx.numel() for idx in per_source_topk_idx], dtype=torch.int64)
    src = torch.repeat_interleave(torch.arange(world_size, dtype=torch.int64), pairs)
    starts = torch.repeat_interleave(torch.cumsum(pairs, 0) - pairs, pairs)
    within = torch.arange(expert.numel(), dtype=torch.int64) - starts  # row * K + k inside its source

    # Masked choices (-1) fall outside [0, E_local) for every destination, so they drop out here.
    local = expert - dest_rank * experts_per_rank
    mine = torch.nonzero((local >= 0) & (local < experts_per_rank)).flatten()
    local_sorted, order = torch.sort(local[mine], stable=True)
    picked = mine[order]

    counts = torch.bincount(local_sorted, minlength=experts_per_rank).to(torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(experts_per_rank + 1, dtype=torch.int64)
    torch.cumsum(padded, 0, out=offsets[1:])
    # A real row's destination: its group's padded start plus its rank within the (unpadded) group.
    group_start = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(picked.numel(), dtype=torch.int64) - group_start[local_sorted]
    dest = offsets[:-1][local_sorted] + rank_in_group

    rows = int(offsets[-1])

    def scatter(values: torch.Tensor, dtype: torch.dtype, fill: float) -> torch.Tensor:
        out = torch.full((rows,), fill, dtype=dtype)
        out[dest] = values[picked].to(dtype)
        return out

    return DispatchPlan(
        expert_offsets=offsets,
        counts=counts,
        src_rank=scatter(src, torch.int32, PAD),
        token_index=scatter(within // K, torch.int64, PAD),
        topk_pos=scatter(within % K, torch.int32, PAD),
        weight=scatter(weight, torch.float32, 0.0),
        dest_rank=dest_rank,
        experts_per_rank=experts_per_rank,
        block_m=block_m,
    )


# -- validation: everything is checked before any planning work starts -------------------------------------


def _check_int(field: str, value: object, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ChunkringUsageError(f"must be an int, got {type(value).__name__}", field=field)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ChunkringUsageError(f"must be in [{low}, {'inf' if high is None else high}], got {value}", field=field)


def _check_per_source(per_source_topk_idx: list, per_source_topk_weights: list, world_size: int,
                      num_experts: int) -> None:
    """One [n_s, K] CPU pair per source, one K for all, and every index in [-1, num_experts)."""
    idx_field, weights_field = "per_source_topk_idx", "per_source_topk_weights"
    for field, value in ((idx_field, per_source_topk_idx), (weights_field, per_source_topk_weights)):
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            raise ChunkringUsageError(f"need a list of {world_size} tensors (one per source rank)", field=field)
    topk = None
    for s, (idx, w) in enumerate(zip(per_source_topk_idx, per_source_topk_weights, strict=True)):
        where = f"source {s}: "
        for name, t, dtype, field in (("topk_idx", idx, torch.int32, idx_field),
                                      ("topk_weights", w, torch.float32, weights_field)):
            if not isinstance(t, torch.Tensor):
                raise ChunkringUsageError(f"{where}{name} must be a torch.Tensor, got {type(t).__name__}", field=field)
            # Host-side planner: reading index values from a device tensor would hide a synchronisation.
            if t.device.type != "cpu":
                raise ChunkringUsageError(f"{where}{name} must be a CPU tensor (host-side plan), got {t.device}",
                                          field=field)
            if t.dtype != dtype:
                raise ChunkringUsageError(f"{where}{name} must be {dtype}, got {t.dtype}", field=field)
            if t.dim() != 2 or t.shape[1] < 1:
                raise ChunkringUsageError(f"{where}{name} must have shape [n, K] with K >= 1, got {tuple(t.shape)}",
                                          field=field)
        if w.shape != idx.shape:
            raise ChunkringUsageError(f"{where}topk_weights shape {tuple(w.shape)} != topk_idx shape "
                                      f"{tuple(idx.shape)}", field=weights_field)
        if topk is None:
            topk = idx.shape[1]
        elif idx.shape[1] != topk:
            raise ChunkringUsageError(f"{where}K = {idx.shape[1]}, but source 0 has K = {topk}", field=idx_field)
    for s, idx in enumerate(per_source_topk_idx):
        # A host-side check: the device dispatch trusts its indices, so a bad one must stop here.
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            raise ChunkringUsageError(f"source {s}: expert indices must be in [-1, {num_experts}), got "
                                      f"[{int(idx.min())}, {int(idx.max())}]", field=idx_field)
