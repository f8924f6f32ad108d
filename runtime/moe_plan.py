"""Host-side dispatch plans for the MoE layer: which (token, k) rows land where at one destination.

A destination rank gathers every (token, k) pair routed to one of its local experts, groups the pairs by
local expert and pads each group up to a multiple of the GEMM block ``block_m``. Within a group the
order is fixed: source rank, then row, then ``k``; so a plan is a pure function of its inputs and two
runs agree bitwise. :func:`plan_batch` groups a whole call's rows (every source's batch): what the
layer's consumer does for batch-ready and streamed calls alike (:func:`chunkring.moe_dispatch.plan_experts`
is tested against it). :func:`plan_streamed` / :func:`plan_chunk_step` group each chunk step separately
(chunk-local expert pools, RFC option 1), the alternative the layer measured and left because each step
re-reads the expert weights (benchmarks/results/README.md); they stay as the reference of that rule.

Everything here runs on the host, on CPU tensors, and checks index values (a device kernel could not
without a synchronisation). It is the reference the device dispatch is tested against, and
:func:`padded_rows_bound` sizes the fixed-shape device buffers the consumer writes into.

Conventions (as in :mod:`chunkring.layout`): ``topk_idx`` int32 [n, K], -1 = masked choice;
``topk_weights`` float32 [n, K]; rank ``d`` of ``W`` owns experts ``[d * E / W, (d + 1) * E / W)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ChunkringUsageError

__all__ = [
    "ChunkRoute",
    "DispatchPlan",
    "padded_rows_bound",
    "plan_batch",
    "plan_chunk_step",
    "plan_streamed",
    "split_into_chunks",
]

#: Marks a padding row in the int32/int64 row tensors of a :class:`DispatchPlan`.
PAD = -1


@dataclass(frozen=True, eq=False)  # eq on tensors is ambiguous; compare fields with torch.equal
class ChunkRoute:
    """The routing of one chunk of one source rank.

    topk_idx: int32 [n, K] (-1 = masked).   topk_weights: float32 [n, K].
    chunk_index: the chunk's index within its source's stream.
    token_base: logical index (within the source's batch) of the chunk's row 0.
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    chunk_index: int
    token_base: int

    def __post_init__(self):
        _check_route_tensors(self.topk_idx, self.topk_weights, "topk_idx", "topk_weights")
        _check_int("chunk_index", self.chunk_index, low=0)
        _check_int("token_base", self.token_base, low=0)

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]

    def __repr__(self) -> str:
        return (f"ChunkRoute(chunk_index={self.chunk_index}, token_base={self.token_base}, "
                f"shape={tuple(self.topk_idx.shape)})")


@dataclass(frozen=True, eq=False)  # eq on tensors is ambiguous; compare fields with torch.equal
class DispatchPlan:
    """Where one destination rank's rows go for one chunk step (or the whole batch).

    Rows are grouped by local expert; group ``e`` occupies padded rows
    ``[expert_offsets[e], expert_offsets[e + 1])``, its first ``counts[e]`` rows real, the rest padding.

    expert_offsets: int64 [E_local + 1], a multiple of ``block_m`` each; last = total padded rows P.
    counts:         int64 [E_local], real rows per local expert.
    Per padded row, [P] each (padding rows: -1, weight 0):
    src_rank int32, src_chunk int32 (chunk index within its source), src_row int32 (row within the chunk),
    topk_pos int32 (k), weight float32, token_index int64 (chunk's token_base + src_row).
    dest_rank, experts_per_rank, block_m: what the plan was built for (global expert =
    dest_rank * experts_per_rank + local expert).
    """

    expert_offsets: torch.Tensor
    counts: torch.Tensor
    src_rank: torch.Tensor
    src_chunk: torch.Tensor
    src_row: torch.Tensor
    topk_pos: torch.Tensor
    weight: torch.Tensor
    token_index: torch.Tensor
    dest_rank: int
    experts_per_rank: int
    block_m: int

    def __post_init__(self):
        # Cheap structural checks only (no value scans): a plan is usually built by this module.
        e_local = self.experts_per_rank
        for name, dtype, length in (("expert_offsets", torch.int64, e_local + 1), ("counts", torch.int64, e_local)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (length,):
                raise ChunkringUsageError(f"need a {dtype} tensor of shape [{length}]", field=name)
        rows = int(self.expert_offsets[-1])
        for name, dtype in (("src_rank", torch.int32), ("src_chunk", torch.int32), ("src_row", torch.int32),
                            ("topk_pos", torch.int32), ("weight", torch.float32), ("token_index", torch.int64)):
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
        return sorted(zip(*columns))

    def __repr__(self) -> str:
        return (f"DispatchPlan(dest_rank={self.dest_rank}, experts_per_rank={self.experts_per_rank}, "
                f"block_m={self.block_m}, real_rows={self.num_real_rows}, padded_rows={self.num_padded_rows})")


def padded_rows_bound(tokens_per_slot: int, topk: int, world_size: int, experts_per_rank: int, block_m: int) -> int:
    """The most padded rows one chunk step can produce at one destination (size of fixed device buffers).

    Derivation: a step holds at most ``world_size`` chunks of ``tokens_per_slot`` rows, each with ``topk``
    choices, so at most ``R = W * C * K`` real rows reach one destination (K, not min(K, E_local): nothing
    forbids a row from naming one expert twice, and each (token, k) is its own row). A group of ``c >= 1``
    rows pads to ``block_m * ceil(c / block_m)`` and an empty group to 0. With ``g`` non-empty groups the
    block count is ``sum(1 + (c_e - 1) // block_m) <= g + (R - g) // block_m``, which does not decrease
    with ``g``; so take ``g = min(E_local, R)``. It is reached (``g - 1`` groups of one row, one group of
    the rest), so the bound is tight:  ``block_m * (g + (R - g) // block_m)``.
    """
    for name, value in (("tokens_per_slot", tokens_per_slot), ("topk", topk), ("world_size", world_size),
                        ("experts_per_rank", experts_per_rank), ("block_m", block_m)):
        _check_int(name, value, low=1)
    real = world_size * tokens_per_slot * topk
    groups = min(experts_per_rank, real)
    return block_m * (groups + (real - groups) // block_m)


def split_into_chunks(topk_idx: torch.Tensor, topk_weights: torch.Tensor, tokens_per_slot: int) -> list[ChunkRoute]:
    """One source's routing cut into chunks of ``tokens_per_slot`` rows (views, not copies).

    topk_idx: int32 [n, K]; topk_weights: float32 [n, K]. Chunk ``c`` holds tokens
    ``[c * C, min((c + 1) * C, n))``; zero tokens give one empty chunk, because every stream publishes
    at least one chunk (its end-of-stream marker, docs/PROTOCOL.md "invocation").
    """
    _check_int("tokens_per_slot", tokens_per_slot, low=1)
    _check_route_tensors(topk_idx, topk_weights, "topk_idx", "topk_weights")
    n = topk_idx.shape[0]
    starts = range(0, n, tokens_per_slot) if n else [0]
    return [ChunkRoute(topk_idx[s:s + tokens_per_slot], topk_weights[s:s + tokens_per_slot], c, s)
            for c, s in enumerate(starts)]


def plan_chunk_step(chunks: list, *, dest_rank: int, world_size: int, num_experts: int, block_m: int) -> DispatchPlan:
    """The plan of one chunk step at ``dest_rank``.

    chunks: list over source ranks (length ``world_size``) of ``None`` (that source's stream ended) or a
    :class:`ChunkRoute`; every present chunk must carry the same ``chunk_index`` (it is one step) and the
    same K. Host-side: ``topk_idx`` values are checked to lie in [-1, num_experts).
    """
    _check_world(dest_rank, world_size, num_experts, block_m)
    if not isinstance(chunks, (list, tuple)) or len(chunks) != world_size:
        raise ChunkringUsageError(f"need a list of {world_size} entries (one per source rank)", field="chunks")
    present = [c for c in chunks if c is not None]
    for s, c in enumerate(chunks):
        if c is not None and not isinstance(c, ChunkRoute):
            raise ChunkringUsageError(f"source {s}: expected a ChunkRoute or None, got {type(c).__name__}",
                                      field="chunks")
    if len({c.chunk_index for c in present}) > 1:
        raise ChunkringUsageError(f"one step takes the same chunk of every source, got chunk indices "
                                  f"{[None if c is None else c.chunk_index for c in chunks]}", field="chunks")
    _check_routes([c.topk_idx for c in present], [c.topk_weights for c in present], num_experts,
                  "chunks", "chunks")
    return _plan(chunks, dest_rank, num_experts // world_size, block_m)


def plan_batch(per_source_topk_idx: list, per_source_topk_weights: list, *, dest_rank: int, world_size: int,
               num_experts: int, block_m: int) -> DispatchPlan:
    """The batch-ready plan at ``dest_rank``: every source's whole batch as its one chunk (index 0, base 0).

    per_source_topk_idx: ``world_size`` int32 [n_s, K]; per_source_topk_weights: float32 [n_s, K].
    """
    _check_world(dest_rank, world_size, num_experts, block_m)
    _check_per_source(per_source_topk_idx, per_source_topk_weights, world_size, num_experts)
    chunks = [ChunkRoute(i, w, 0, 0) for i, w in zip(per_source_topk_idx, per_source_topk_weights)]
    return _plan(chunks, dest_rank, num_experts // world_size, block_m)


def plan_streamed(per_source_topk_idx: list, per_source_topk_weights: list, *, tokens_per_slot: int,
                  dest_rank: int, world_size: int, num_experts: int, block_m: int) -> list[DispatchPlan]:
    """The plans of every chunk step at ``dest_rank``, step ``j`` at index ``j``, until every stream ended.

    per_source_topk_idx: ``world_size`` int32 [n_s, K]; per_source_topk_weights: float32 [n_s, K].
    There are ``max_s max(1, ceil(n_s / tokens_per_slot))`` steps; a source with fewer chunks is ``None``
    (skipped) in the later steps.
    """
    _check_int("tokens_per_slot", tokens_per_slot, low=1)
    _check_world(dest_rank, world_size, num_experts, block_m)
    _check_per_source(per_source_topk_idx, per_source_topk_weights, world_size, num_experts)
    streams = [split_into_chunks(i, w, tokens_per_slot)
               for i, w in zip(per_source_topk_idx, per_source_topk_weights)]
    steps = max(len(s) for s in streams)
    experts_per_rank = num_experts // world_size
    return [_plan([s[j] if j < len(s) else None for s in streams], dest_rank, experts_per_rank, block_m)
            for j in range(steps)]


def _plan(chunks: list, dest_rank: int, experts_per_rank: int, block_m: int) -> DispatchPlan:
    """Build a plan from validated chunks; vectorised over every (source, row, k) of the step."""
    live = [(s, c) for s, c in enumerate(chunks) if c is not None and c.num_tokens > 0]
    if live:
        K = live[0][1].topk_idx.shape[1]
        # Flatten in (source, row, k) order: the stable sort by expert below keeps exactly this order
        # within each expert's group, which is the ordering rule of the module docstring.
        expert = torch.cat([c.topk_idx.reshape(-1) for _, c in live]).to(torch.int64)
        weight = torch.cat([c.topk_weights.reshape(-1) for _, c in live])
        pairs = torch.tensor([c.num_tokens * K for _, c in live], dtype=torch.int64)
        src = torch.repeat_interleave(torch.tensor([s for s, _ in live], dtype=torch.int64), pairs)
        chunk = torch.repeat_interleave(torch.tensor([c.chunk_index for _, c in live], dtype=torch.int64), pairs)
        base = torch.repeat_interleave(torch.tensor([c.token_base for _, c in live], dtype=torch.int64), pairs)
        starts = torch.repeat_interleave(torch.cumsum(pairs, 0) - pairs, pairs)
        within = torch.arange(expert.numel(), dtype=torch.int64) - starts  # row * K + k inside its chunk
    else:
        K = 1
        expert = src = chunk = base = within = torch.empty(0, dtype=torch.int64)
        weight = torch.empty(0, dtype=torch.float32)

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

    def scatter(values: torch.Tensor, dtype: torch.dtype, fill) -> torch.Tensor:
        out = torch.full((rows,), fill, dtype=dtype)
        out[dest] = values[picked].to(dtype)
        return out

    row = within // K
    return DispatchPlan(
        expert_offsets=offsets,
        counts=counts,
        src_rank=scatter(src, torch.int32, PAD),
        src_chunk=scatter(chunk, torch.int32, PAD),
        src_row=scatter(row, torch.int32, PAD),
        topk_pos=scatter(within % K, torch.int32, PAD),
        weight=scatter(weight, torch.float32, 0.0),
        token_index=scatter(base + row, torch.int64, PAD),
        dest_rank=dest_rank,
        experts_per_rank=experts_per_rank,
        block_m=block_m,
    )


# -- validation: everything is checked before any planning work starts -------------------------------------


def _check_int(field: str, value, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ChunkringUsageError(f"must be an int, got {type(value).__name__}", field=field)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ChunkringUsageError(f"must be in [{low}, {'inf' if high is None else high}], got {value}", field=field)


def _check_world(dest_rank: int, world_size: int, num_experts: int, block_m: int) -> None:
    _check_int("world_size", world_size, low=1)
    _check_int("num_experts", num_experts, low=1)
    if num_experts % world_size:
        raise ChunkringUsageError(f"{num_experts} experts do not split evenly over {world_size} ranks",
                                  field="num_experts")
    _check_int("block_m", block_m, low=1)
    _check_int("dest_rank", dest_rank, low=0, high=world_size - 1)


def _check_route_tensors(topk_idx, topk_weights, idx_field: str, weights_field: str, where: str = "") -> None:
    """Types, devices, dtypes and shapes of one [n, K] routing pair (no value scan)."""
    for name, t, dtype, field in (("topk_idx", topk_idx, torch.int32, idx_field),
                                  ("topk_weights", topk_weights, torch.float32, weights_field)):
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
    if topk_weights.shape != topk_idx.shape:
        raise ChunkringUsageError(f"{where}topk_weights shape {tuple(topk_weights.shape)} != topk_idx shape "
                                  f"{tuple(topk_idx.shape)}", field=weights_field)


def _check_routes(idx_list: list, weights_list: list, num_experts: int, idx_field: str, weights_field: str) -> None:
    """Every source's pair, one K for all, and every index in [-1, num_experts)."""
    topk = None
    for s, (idx, w) in enumerate(zip(idx_list, weights_list)):
        _check_route_tensors(idx, w, idx_field, weights_field, where=f"source {s}: ")
        if topk is None:
            topk = idx.shape[1]
        elif idx.shape[1] != topk:
            raise ChunkringUsageError(f"source {s}: K = {idx.shape[1]}, but source 0 has K = {topk}", field=idx_field)
    for s, idx in enumerate(idx_list):
        # A host-side check: the device dispatch trusts its indices, so a bad one must stop here.
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            raise ChunkringUsageError(f"source {s}: expert indices must be in [-1, {num_experts}), got "
                                      f"[{int(idx.min())}, {int(idx.max())}]", field=idx_field)


def _check_per_source(per_source_topk_idx, per_source_topk_weights, world_size: int, num_experts: int) -> None:
    for field, value in (("per_source_topk_idx", per_source_topk_idx),
                         ("per_source_topk_weights", per_source_topk_weights)):
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            raise ChunkringUsageError(f"need a list of {world_size} tensors (one per source rank)", field=field)
    _check_routes(per_source_topk_idx, per_source_topk_weights, num_experts,
                  "per_source_topk_idx", "per_source_topk_weights")
