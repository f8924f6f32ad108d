"""The consumer's expert work at one rank: plan the pulled rows into expert groups, L1 -> SwiGLU -> L2,
and push each weighted row to its source's combine buffer (device/kernels/moe_experts.cu, driven here).

FP8 payload: FP8 end to end, DeepSeek's recipe - the rows go to the GEMM as published (e4m3 with one
fp32 scale per 1x128), the expert weights are e4m3 with one fp32 scale per 128x128 block
(:class:`~chunkring.moe.weights.Fp8Weight`), and SwiGLU's output is quantised per 1x128 again before L2.
The GEMMs are DeepGEMM's m-grouped FP8 GEMMs in the contiguous layout: the planned rows of each expert
form a group starting at a multiple of :data:`GROUP_ALIGN` rows, and the GEMMs take each group's end
(the "psum" form of the layout), so they visit only the blocks of each expert's rows: the buffers' spare
capacity past the last group costs nothing.
bf16 payload: the same plan, bf16 weights and ``torch._grouped_mm``.

Why the contiguous layout and not the masked one (``[E, max_m, K]`` with per-expert counts): a masked
buffer must hold the worst case of every expert at once, ``E_local * W * N`` rows (1 GB of FP8 rows per
layer at 32 experts and 8,192 tokens), where the contiguous one holds the worst case of all experts
together, ``W * N * K`` rows plus padding; the masked GEMM measured 10-15 % faster only below ~1,000
tokens on the H200 (docs/notes_deepgemm.md).

Every shape here depends only on the layer's configuration, never on the call's routing: the kernels are
fixed grids that loop over the rows the call brought, and nothing reads a device value on the host, so a
call captures into a CUDA graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.blocks import BlockPool
from chunkring.moe._engine.decode import DecodeGemm
from chunkring.moe._engine.kernel_args import CombinePushArgs, CombineReduceArgs, PlanScatterArgs, WaveGatherArgs
from chunkring.moe._engine.persistent import PersistentGemm
from chunkring.moe.gemm import GROUP_ALIGN, load_deep_gemm, padded_rows_bound
from chunkring.moe.weights import Fp8Weight
from chunkring.ring.io import check_row_aligned, check_tensor
from chunkring.ring.spec import FP8_SCALE_BLOCK

if TYPE_CHECKING:
    from chunkring.jit import KernelArgs
    from chunkring.moe._engine.stage import Stage

__all__ = ["DevicePlan", "EmptyPlan", "ExpertCompute", "OwnRows", "check_expert_weights"]

#: Threads per block of the expert kernels; their grids fill every SM (8 x 256 threads) and loop over rows:
#: each row is a short dependent chain (load, compute, store), so latency hiding needs many rows in flight.
_BLOCK = 256
_BLOCKS_PER_SM = 8


@dataclass(frozen=True)
class DevicePlan:
    """One call's plan at this rank, on the device (P = :attr:`ExpertCompute.capacity` rows).

    counts int32 [E_local]: real rows per local expert; group e is rows [offset(e), offset(e) + counts[e]),
    offset(e) the padded counts' exclusive prefix sum (:data:`GROUP_ALIGN` rows each); group_end int32
    [E_local]: offset(e) + counts[e] (DeepGEMM's psum layout).  Per row [P]: src int32 (-1 on padding
    rows and past the last group), token, k int32, weight fp32 (unspecified there).  rows uint8 [P, row
    bytes]: the payload (FP8 or bf16 bytes); rows_sf fp32 [H / 128, P]: the FP8 rows' scales, MN-major as
    the GEMM takes them. own_row int32 [N * K] (N = ``max_tokens_per_rank``): the row of each choice of this
    rank's own tokens at token * K + k, -1 elsewhere (``moe_plan_scatter`` fills it; a wave's plan leaves it -1).
    """

    counts: torch.Tensor
    group_end: torch.Tensor
    src: torch.Tensor
    token: torch.Tensor
    k: torch.Tensor
    weight: torch.Tensor
    rows: torch.Tensor
    rows_sf: torch.Tensor
    own_row: torch.Tensor

    def scatter_args(self) -> KernelArgs:
        """What the kernels that fill a plan (``moe_plan_scatter``, ``moe_wave_gather``) write into, by their
        argument structs' field names; ``sf_stride``: the GEMM's scale layout, scale j of row p at j * P + p."""
        return {"counts": self.counts, "rows": self.rows, "rows_sf": self.rows_sf, "sf_stride": self.rows_sf.shape[1],
                "row_src": self.src, "row_token": self.token, "row_k": self.k, "row_weight": self.weight,
                "group_end": self.group_end}

    def group_args(self) -> KernelArgs:
        """The plan's rows and groups as the kernels that walk them (SwiGLU, combine push) take them."""
        return {"row_src": self.src, "counts": self.counts, "num_local": self.counts.shape[0],
                "block_m": GROUP_ALIGN}


@dataclass(frozen=True)
class OwnRows:
    """Where a call's own choices - this rank's tokens routed to this rank's experts - are, for its reduction
    (:meth:`ExpertCompute.reduce`): the batch plan's ``own_row`` (int32 [N * K]: the row of ``out`` holding choice
    token * K + k, -1 for every other choice) and ``out`` (bf16 [P, H], the experts' rows, unweighted). The combine
    push leaves those rows there instead of copying them into this rank's own combine buffer. Allocated on the
    stream that ran the experts: it must not run anything that reuses them before the reduction has read them."""

    row: torch.Tensor
    out: torch.Tensor


def check_expert_weights(config, experts_per_rank: int, device, w13, w2) -> None:
    """The weights this payload's GEMMs take: FP8 -> :class:`Fp8Weight` w13 [E_local, 2I, H] and w2
    [E_local, H, I]; bf16 -> bfloat16 tensors of those shapes; contiguous, starting on a 16-byte boundary. A
    ``ChunkringUsageError`` otherwise."""
    E, H, inter = experts_per_rank, config.hidden, config.intermediate
    for name, w, shape in (("w13", w13, (E, 2 * inter, H)), ("w2", w2, (E, H, inter))):
        if config.payload.has_scales:
            if not isinstance(w, Fp8Weight):
                raise ChunkringUsageError(
                    "the FP8 payload runs FP8 expert GEMMs: pass a chunkring.moe.Fp8Weight (quantise bf16 weights "
                    f"once with chunkring.expert_weights or quantize_weight_fp8), got {type(w).__name__}", field=name)
            check_tensor(name, w.data, shape, torch.float8_e4m3fn, device)
            check_row_aligned(name, w.data)  # DeepGEMM's TMA and the decode kernels load 16 bytes at a time
            check_tensor(f"{name}.scale", w.scale, tuple(w.scale.shape), torch.float32, device)
        else:
            check_tensor(name, w, shape, torch.bfloat16, device)
            check_row_aligned(name, w)  # torch's grouped GEMM reads 16-byte aligned rows


#: A plan's buffers with no rows planned and the scatter's per-expert cursors (:meth:`ExpertCompute.empty_plan`).
EmptyPlan = tuple[DevicePlan, torch.Tensor]


class ExpertCompute:
    """The expert work of one layer at one rank, enqueued on the current stream by :meth:`__call__`.

    ``capacity`` (P): the most planned rows one call can produce here, every source's full batch
    routed to this rank's experts (:func:`~chunkring.moe.gemm.padded_rows_bound`). ``decode``: the decode path's
    engine of the FP8 expert GEMMs (L1, SwiGLU, L2) in place of DeepGEMM's - the persistent consumer
    (:class:`~chunkring.moe._engine.persistent.PersistentGemm`, what a layer builds) or the decode kernels
    (:class:`~chunkring.moe._engine.decode.DecodeGemm`) - or None (DeepGEMM's only). ``deep_gemm_too``: with
    ``decode``, DeepGEMM's engine as well, each call choosing (the ``decode=`` of :meth:`experts`; the layer's
    ``decode="auto"``); without it, every call of an FP8 layer given ``decode`` takes the decode path.
    """

    def __init__(self, config, world_size: int, first_expert: int, experts_per_rank: int, kernels, device, *,
                 decode: PersistentGemm | DecodeGemm | None = None, deep_gemm_too: bool = False):
        if decode is not None and not isinstance(decode, (PersistentGemm, DecodeGemm)):
            raise ChunkringUsageError(f"expected a PersistentGemm, a DecodeGemm or None, got {type(decode).__name__}",
                                      field="decode")
        if not isinstance(deep_gemm_too, bool):
            raise ChunkringUsageError(f"expected a bool, got {deep_gemm_too!r}", field="deep_gemm_too")
        self.config, self.kernels, self.device, self.decode = config, kernels, device, decode
        self.first_expert, self.experts_per_rank = first_expert, experts_per_rank
        self.rank = first_expert // experts_per_rank  # the stage's source index of this rank's own tokens
        self.fp8 = config.payload.has_scales
        self.capacity = padded_rows_bound(config.max_tokens_per_rank, config.topk, world_size, experts_per_rank,
                                          GROUP_ALIGN)
        # DeepGEMM runs the FP8 GEMMs unless the decode path runs every call (deep_gemm is untyped).
        self._deep_gemm: Any = load_deep_gemm() if self.fp8 and (decode is None or deep_gemm_too) else None
        self._grid = _BLOCKS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        # moe_combine_push's arrivals: each block adds 1 after releasing its stores; moe_ack_held waits for
        # push_blocks of them before the held acks (docs/PROTOCOL.md, "The MoE layer on the ring").
        self.pushed = torch.zeros(1, dtype=torch.int64, device=device)
        self.push_blocks = self._grid
        self._offsets_bytes = 4 * (experts_per_rank + 1)  # group_offsets' shared memory
        self._warm: set[int | None] = set()  # the SM counts (warm_up's sms) whose GEMM kernels are loaded
        self._checked_stage: Stage | None = None  # the stage _check_stage accepted (a layer plans from one stage)
        # bf16 [P, H] in NVSHMEM-registered memory, set by a layer with RMA peers: the experts' output, whose
        # rows the combine push puts from (an RMA put's local buffer must be registered off-node).
        self.rma_out: torch.Tensor | None = None
        # A wave that is not the last waits for this many sealed, unclaimed blocks (or for the end of every
        # stream): one block per local expert on average, so a wave reads each expert's weights for about a
        # block's worth of rows or more.
        self.wave_min_blocks = experts_per_rank

    def warm_up(self, w13, w2, *, sms: int | None = None) -> None:
        """Run the expert GEMMs once on an empty plan (no rows: they visit no block), on the current
        stream, so the GEMM engine compiles and loads its kernels now. DeepGEMM compiles a kernel at its
        first use and loads the module then, and a module load waits for the kernels already running: a
        call's first GEMM, enqueued while its pull waits for chunks the host has not enqueued yet, never
        returned (a first call that streamed deadlocked on the H200). The layer calls this before it
        enqueues anything that spins; the kernels depend only on the layer's shapes and on ``sms``
        (:meth:`gemm_sms`), so once per SM count suffices."""
        if sms in self._warm or self._deep_gemm is None:  # the decode kernels load with their library
            return
        plan, _ = self.empty_plan()  # every count 0
        with self.gemm_sms(sms):
            self.experts(plan, w13, w2, decode=False)
        self._warm.add(sms)

    def __call__(self, stage, w13, w2, peer_combine: torch.Tensor, on_experts_done, *,
                 desc: torch.Tensor | None = None, combine: torch.Tensor | None = None, sms: int | None = None,
                 decode: bool | None = None, empty: EmptyPlan | None = None) -> OwnRows:
        """Plan ``stage``'s rows (moe_pull's output), run the experts, call ``on_experts_done`` (a timeline
        mark) and push the weighted rows to each other source (:meth:`combine_push`); returns where this rank's own
        choices are, for its :meth:`reduce`. ``sms``: the SMs the current stream may use (its green-context
        partition's), None for the whole GPU (:meth:`gemm_sms`); ``decode``: as :meth:`experts` takes it;
        ``empty``: as :meth:`plan` takes it."""
        plan = self.plan(stage, empty)
        with self.gemm_sms(sms):
            out = self.experts(plan, w13, w2, decode=decode, sms=sms)
        on_experts_done()
        self.combine_push(plan, out, peer_combine, desc=desc, combine=combine, keep_own=True)
        return OwnRows(plan.own_row, out)

    @contextlib.contextmanager
    def gemm_sms(self, sms: int | None) -> Iterator[None]:
        """Enqueue DeepGEMM's GEMMs for ``sms`` SMs inside the block (None: unchanged, the whole GPU). Its
        persistent grids have ``get_num_sms()`` blocks, the whole GPU unless set: on a partition of fewer
        SMs the blocks past it would run as a second wave after the others. The setting is process-wide, so
        it is restored on exit; a CUDA graph keeps the grid it captured."""
        dg = self._deep_gemm
        if sms is None or dg is None:
            yield
            return
        before = dg.get_num_sms()
        dg.set_num_sms(sms)
        try:
            yield
        finally:
            dg.set_num_sms(before)

    def plan(self, stage: Stage, empty: EmptyPlan | None = None) -> DevicePlan:
        """Every staged choice of a local expert in its expert's group, with its payload copied there. ``empty``:
        the plan to fill, as :meth:`empty_plan` made it earlier in stream order (a layer resets it before its
        pull, while the pull waits for chunks); None: one made here."""
        plan, cursors = empty if empty is not None else self.empty_plan()
        self._check_stage_once(stage, plan)
        self._launch("moe_plan_count", stage=stage.desc, counts=plan.counts)
        self._launch("moe_plan_scatter", shared=True, pdl=True, args=PlanScatterArgs(
            stage=stage.desc, block_m=GROUP_ALIGN, cursors=cursors, own_rank=self.rank, own_row=plan.own_row,
            **plan.scatter_args()))
        return plan

    def _check_stage_once(self, stage: Stage, plan: DevicePlan) -> None:
        if stage is not self._checked_stage:  # a Stage never changes its tensors or shapes: checked once
            self._check_stage(stage, plan)
            self._checked_stage = stage

    def _check_stage(self, stage: Stage, plan: DevicePlan) -> None:
        """The plan kernels take the expert range and the row sizes from ``stage``'s descriptor but write into
        buffers sized here: the two must agree, or the kernels would write past them."""
        row_bytes = stage.x.shape[2] * stage.x.element_size()
        got = (stage.expert_lo, stage.expert_hi, row_bytes, stage.sf.shape[2], stage.idx.shape[2])
        want = (self.first_expert, self.first_expert + self.experts_per_rank, plan.rows.shape[1],
                plan.rows_sf.shape[0], self.config.topk)
        if got != want:
            raise ChunkringUsageError(f"this stage (experts [{got[0]}, {got[1]}), {got[2]} bytes and {got[3]} scales "
                                      f"a row, top-{got[4]}) is not this layer's (experts [{want[0]}, {want[1]}), "
                                      f"{want[2]} bytes and {want[3]} scales a row, top-{want[4]})", field="stage")
        W, N = stage.idx.shape[0], stage.idx.shape[1]
        if N * self.config.topk > plan.own_row.numel() or self.rank >= W:
            raise ChunkringUsageError(f"a stage of {W} x {N} rows does not fit this layer's rank {self.rank} of "
                                      f"{self.config.max_tokens_per_rank} tokens", field="stage")
        if padded_rows_bound(N, self.config.topk, W, self.experts_per_rank, GROUP_ALIGN) > self.capacity:
            raise ChunkringUsageError(f"a stage of {stage.idx.shape[0]} x {stage.idx.shape[1]} rows can plan past "
                                      f"the {self.capacity} rows of this layer's plan", field="stage")

    def empty_plan(self) -> EmptyPlan:
        """A plan's buffers with no rows planned (every count 0, every row padding, no own choice: ``moe_plan_reset``,
        one launch on the current stream), and the scatter's per-expert cursors (0)."""
        plan, counters = self._new_plan()
        self.kernels.launch("moe_plan_reset", counters=counters, counter_words=counters.numel(), row_src=plan.src,
                            rows=self.capacity, own_row=plan.own_row, own_choices=plan.own_row.numel(),
                            grid=max(1, min(self._grid, -(-max(self.capacity, plan.own_row.numel()) // _BLOCK))),
                            block=_BLOCK, stream=torch.cuda.current_stream(self.device))
        return plan, counters[2]

    def plan_buffers(self, stage: Stage) -> DevicePlan:
        """A plan's buffers as they come, no launch: for a one-rank call's ``moe_local_route`` and
        ``moe_local_scatter``, which write every word the plan's readers read, from ``stage`` (checked against the
        buffers once)."""
        plan, _ = self._new_plan()
        self._check_stage_once(stage, plan)
        return plan

    def _new_plan(self) -> tuple[DevicePlan, torch.Tensor]:
        """A plan's buffers, unwritten, and its counters [3, E_local] (counts, group ends, cursors)."""
        dev, P, E, H = self.device, self.capacity, self.experts_per_rank, self.config.hidden
        counters = torch.empty((3, E), dtype=torch.int32, device=dev)
        row_bytes, sf_per_row = (H, H // FP8_SCALE_BLOCK) if self.fp8 else (2 * H, 0)
        plan = DevicePlan(
            counts=counters[0], group_end=counters[1], src=torch.empty(P, dtype=torch.int32, device=dev),
            token=torch.empty(P, dtype=torch.int32, device=dev), k=torch.empty(P, dtype=torch.int32, device=dev),
            weight=torch.empty(P, dtype=torch.float32, device=dev),
            rows=torch.empty((P, row_bytes), dtype=torch.uint8, device=dev),
            # The GEMM's scale layout (MN-major): scale j of row p at j * P + p.
            rows_sf=torch.empty((sf_per_row, P), dtype=torch.float32, device=dev),
            own_row=torch.empty(self.config.max_tokens_per_rank * self.config.topk, dtype=torch.int32, device=dev))
        return plan, counters

    def experts(self, plan: DevicePlan, w13, w2, *, decode: bool | None = None, sms: int | None = None) -> torch.Tensor:
        """bf16 [P, H]: w2[e] @ swiglu(w13[e] @ row) for every planned row (padding rows: unspecified). ``decode``
        (FP8): this call on the decode path (True) or on DeepGEMM's (False); None: the decode path if this
        compute has one. The engine asked for must be one this compute was built with. ``sms``: the SMs the current
        stream may use (a partition's), None for the whole GPU: the persistent consumer then launches as many
        blocks, not one per SM of the GPU (the blocks past them would run as a second round)."""
        cfg, dev, P = self.config, self.device, self.capacity
        H, inter = cfg.hidden, cfg.intermediate
        if decode is None:
            decode = self.decode is not None
        if decode and self.decode is None:
            raise ChunkringUsageError("this expert work has no decode path", field="decode")
        if self.fp8 and not decode and self._deep_gemm is None:
            raise ChunkringUsageError("this expert work runs every call on the decode path", field="decode")
        if decode:
            assert self.decode is not None  # checked above; either engine needs the FP8 payload
            out = self.rma_out if self.rma_out is not None else torch.empty((P, H), dtype=torch.bfloat16, device=dev)
            if isinstance(self.decode, PersistentGemm) and sms is not None and sms < self.decode.grid():
                # Its variant with a block per SM of the partition (the call checks a variant not its own).
                self.decode(plan, w13, w2, out, stream=torch.cuda.current_stream(dev),
                            variant=replace(self.decode.variant, sms=sms))
            else:
                self.decode(plan, w13, w2, out, stream=torch.cuda.current_stream(dev))
            return out
        if self.fp8:
            dg = self._deep_gemm
            gate_up = torch.empty((P, 2 * inter), dtype=torch.bfloat16, device=dev)
            dg.m_grouped_fp8_gemm_nt_contiguous((plan.rows.view(torch.float8_e4m3fn), plan.rows_sf.t()),
                                                (w13.data, w13.scale), gate_up, plan.group_end, use_psum_layout=True)
            act = torch.empty((P, inter), dtype=torch.float8_e4m3fn, device=dev)
            act_sf = torch.empty((inter // FP8_SCALE_BLOCK, P), dtype=torch.float32, device=dev)
            self._launch("moe_swiglu_fp8", gate_up=gate_up, inter=inter, act=act, act_sf=act_sf, sf_stride=P,
                         shared=True, **plan.group_args())
            out = self.rma_out if self.rma_out is not None else torch.empty((P, H), dtype=torch.bfloat16, device=dev)
            dg.m_grouped_fp8_gemm_nt_contiguous((act, act_sf.t()), (w2.data, w2.scale), out, plan.group_end,
                                                use_psum_layout=True)
            return out
        ends = torch.cumsum((plan.counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN, 0, dtype=torch.int32)
        # Rows past the last group's end are neither read nor written.
        gate_up = torch._grouped_mm(plan.rows.view(torch.bfloat16), w13.transpose(1, 2), offs=ends)
        act = torch.empty((P, inter), dtype=torch.bfloat16, device=dev)
        self._launch("moe_swiglu_bf16", gate_up=gate_up, inter=inter, act=act, shared=True, **plan.group_args())
        out = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)
        if self.rma_out is None:
            return out
        return self.rma_out.copy_(out)  # _grouped_mm allocates its output; the puts need registered memory

    def wave(self, pool: BlockPool, w13, w2, peer_combine: torch.Tensor, *, last: bool, desc: torch.Tensor,
             combine: torch.Tensor | None = None, sms: int | None = None, decode: bool | None = None) -> None:
        """One wave of incremental expert blocks (:mod:`chunkring.moe._engine.blocks`), on the current stream:
        ``moe_wave_claim`` waits (bounded, on ``desc``'s watchdog) until :attr:`wave_min_blocks` sealed blocks
        are unclaimed or, for the ``last`` wave, until every block is sealed, and claims every sealed one;
        ``moe_wave_gather`` copies their rows into a fresh plan; then the batch path's GEMMs, SwiGLU and
        combine push on that plan (``moe_ack_held`` then waits for ``waves * push_blocks`` arrivals on
        :attr:`pushed`, every wave's). ``sms``, ``decode``: as for :meth:`__call__`."""
        if pool.shape.block_m != GROUP_ALIGN:  # the gather aligns groups to the pool's blocks, SwiGLU and the push
            raise ChunkringUsageError(f"the pool's blocks must be the plan's groups, {GROUP_ALIGN} rows, got "
                                      f"{pool.shape.block_m}", field="pool")  # to GROUP_ALIGN: one plan layout
        plan, cursors = self.empty_plan()
        self.kernels.launch("moe_wave_claim", desc=desc, pool_desc=pool.desc, min_blocks=self.wave_min_blocks,
                            last=int(last), counts=plan.counts, grid=1, block=_BLOCK,
                            stream=torch.cuda.current_stream(self.device))
        self._launch("moe_wave_gather", shared=True,
                     args=WaveGatherArgs(pool_desc=pool.desc, cursors=cursors, **plan.scatter_args()))
        with self.gemm_sms(sms):
            out = self.experts(plan, w13, w2, decode=decode, sms=sms)
        self.combine_push(plan, out, peer_combine, desc=desc, combine=combine)

    def combine_push(self, plan: DevicePlan, out: torch.Tensor, peer_combine: torch.Tensor, *,
                     desc: torch.Tensor | None = None, combine: torch.Tensor | None = None,
                     keep_own: bool = False) -> None:
        """Each real row of ``out``, times its weight, to its source's combine buffer at token * K + k:
        stores through ``peer_combine`` (int64 [W]: each source's combine buffer as this GPU addresses it)
        for DIRECT sources, an RMA put to ``combine`` (this rank's symmetric combine buffer) on the source
        for RMA ones - as ``desc`` (a ring descriptor, :attr:`chunkring.Ring.desc`) says; without one every
        source is DIRECT. An RMA row is weighted in place in ``out`` first. ``keep_own``: the rows of this rank's
        own tokens stay in ``out`` unweighted (the batch plan: its :class:`OwnRows` tell the reduction where).
        Then :attr:`pushed` holds :attr:`push_blocks` more (the layer zeroes it once per call, before the call's
        first push)."""
        cfg = self.config
        self._launch("moe_combine_push", shared=True, pdl=True, args=CombinePushArgs(
            out=out, row_token=plan.token, row_k=plan.k, row_weight=plan.weight, hidden=cfg.hidden, topk=cfg.topk,
            peer_combine=peer_combine, desc=desc, combine=combine, own_rank=self.rank if keep_own else -1,
            pushed=self.pushed, **plan.group_args()))

    def reduce(self, combine: torch.Tensor, routing: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
               own: OwnRows | None = None, *, desc: torch.Tensor | None = None) -> None:
        """``out`` [n, H] bf16 = the sum over k of each routed choice's row (``routing``, int32 [>= n, K]: this
        rank's own stage rows as its pull checked them, -1 masked), in fp32 in k order, on the current stream
        (``moe_combine_reduce``): the owner's last step, after its drain. A choice's row is ``combine``'s row
        t * K + k (bf16 [>= n * K, H]), or, for a choice ``own`` names, its row of ``own.out`` times ``weights``
        (fp32 [>= n, K]: this rank's own stage weights), rounded as the push rounds. A masked choice's row is never
        read (no rank wrote it), so nothing zeroes the combine buffer. ``desc``: the call's ring descriptor - where
        this rank recorded an error in that ring (its drain gave up), ``out`` is zeros, never rows another call
        left; None: no ring (a reduction timed alone)."""
        n, H = out.shape
        grid = max(1, min(self._grid, -(-n * H // (8 * _BLOCK))))  # eight values a thread (grid-stride past it)
        self.kernels.launch("moe_combine_reduce", args=CombineReduceArgs(
            desc=desc, combine=combine, routing=routing, weights=weights, own_row=None if own is None else own.row,
            own_out=None if own is None else own.out, out=out, tokens=n, topk=self.config.topk, hidden=H),
            grid=grid, block=_BLOCK, pdl=True, stream=torch.cuda.current_stream(self.device))

    def _launch(self, name: str, *, shared: bool = False, pdl: bool = False, **args: Any) -> None:
        """Kernel ``name`` on the current stream, one block per SM slot of :attr:`_grid`; ``shared``: with
        ``group_offsets``' shared memory (E_local + 1 words); ``pdl``: a dependent launch (a kernel that waits for
        the one ahead of it first: moe_experts.cu, "Dependent launches")."""
        self.kernels.launch(name, grid=self._grid, block=_BLOCK, shared_bytes=self._offsets_bytes if shared else 0,
                            stream=torch.cuda.current_stream(self.device), pdl=pdl, **args)
