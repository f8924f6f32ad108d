"""The persistent decode consumer's host side (issue 44): one kernel, one block per SM, runs a call's whole FP8 expert
work - L1, SwiGLU and the activation's 1x128 FP8 quantisation, L2 - on the plan the layer already builds, writing what
today's decode kernels write (device/kernels/moe_persistent.cu; its design in chunkring/moe/persistent_schedule.cuh).

:class:`PersistentGemm` takes the arguments :class:`DecodeGemm` takes (a plan's ``counts``, ``group_end``, ``rows``
and ``rows_sf``, the two :class:`~chunkring.moe.weights.Fp8Weight`, a bf16 ``out``), so it can stand where that is
called. Its variants (:class:`PersistentVariant`: ring depths, the widest token tile, the order blocks claim units in,
one fused launch or an L1 and an L2 launch, blocks, L1 units of half a chunk) are launch arguments, so one process
measures a sweep.

Weights are read in the checkpoint's layout: w13's gate and up rows are interleaved by 8 on the way into shared
memory by a 5-D tensor map (:func:`w13_view`), not by a transformed copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.jit.tensor_map import TensorMap, TiledArguments, encode_arguments, tiled_arguments
from chunkring.moe._engine.decode import check_plan_gemm
from chunkring.moe._engine.kernel_args import PersistentGemmArgs
from chunkring.moe.weights import WEIGHT_BLOCK, Fp8Weight

if TYPE_CHECKING:
    from chunkring.jit import KernelLibrary
    from chunkring.moe._engine.decode import PlanTensors
    from chunkring.moe.config import MoEConfig

__all__ = ["CLAIMS", "FAULT_KINDS", "LAYER_VARIANT", "MAX_EXPERTS", "MAX_STAGES", "MAX_TOKEN_STAGES",
           "PERSISTENT_ARCH", "PERSISTENT_THREADS", "STATIC_SHARED", "TILE_TOKENS", "TIMELINE_WORDS", "W13_BOXES",
           "PersistentGemm", "PersistentVariant", "block_units", "check_persistent_config", "fault_of", "shared_bytes",
           "w13_view"]

#: Threads per block: two math warpgroups and the loaders' (persistent_schedule.cuh kThreads).
PERSISTENT_THREADS = 384
#: Token tiles (wgmma N) a pass may take; ``tile_cap`` is one of them (kMaxTile: more rows take more passes).
TILE_TOKENS = (8, 16, 32, 64)
#: Ring depths the kernel takes (util::kMaxStages, kMaxTokenStages) and local experts it holds (kMaxExperts).
MAX_STAGES, MAX_TOKEN_STAGES, MAX_EXPERTS = 32, 8, 256
#: The shared-memory layout's constants (persistent_schedule.cuh): a 16 KB weight stage, 128 bytes of k per token
#: row, 8 math warps, the alignment slack.
_WEIGHT_STAGE_BYTES, _KBLOCK, _MATH_WARPS, _STAGE_ALIGN = 16384, 128, 8, 1024
#: An upper bound of the kernel's static shared memory (barriers, the active-expert list, the dynamic claim's slots,
#: the math's times: 4,688 bytes as ptxas builds it, tests/compile/test_persistent_kernel.py), which counts against a
#: block's limit with the dynamic.
STATIC_SHARED = 4736
#: How blocks take units from the list (append-only codes: kStridedExperts, kStridedBlocks, kBlocked, kDynamic).
CLAIMS = {"strided_experts": 0, "strided_blocks": 1, "blocked": 2, "dynamic": 3}
_PHASE_L1, _PHASE_L2, _PHASE_BOTH = 1, 2, 3
#: Words of a block's timeline record: start, first weight stage landed, last L1 unit, last L2 unit, end (global-timer
#: ns), L1 and L2 units, SM.
TIMELINE_WORDS = 8
#: What a faulting block waited for (persistent_schedule.cuh kFault*).
FAULT_KINDS = {1: "arguments out of range", 2: "a group not starting on 8 rows", 3: "weight loader: a free stage",
               4: "token loader: a free stage", 5: "math: a weight stage", 6: "math: a token stage",
               7: "token loader: the expert's L1 units", 9: "weight loader: a free claim slot",
               10: "token loader or math: a claimed unit"}
#: How long any of the kernel's waits may take before it records a fault and traps.
DEFAULT_WAIT_LIMIT_NS = 10_000_000_000
#: Tensor maps of per-call tensors kept (by address and shape), so a call whose tensors land where an earlier call's
#: did encodes none.
_MAP_CACHE = 64


def shared_bytes(stages: int, token_stages: int, tile_cap: int) -> int:
    """The dynamic shared memory a launch gives (persistent_schedule.cuh launch_shared_bytes): weight stages, token
    tiles and their scales, the L1 epilogue's absmax, and the alignment slack."""
    return (stages * _WEIGHT_STAGE_BYTES + token_stages * tile_cap * (_KBLOCK + 4) + _MATH_WARPS * tile_cap * 4
            + _STAGE_ALIGN)


def fault_of(word: int) -> str | None:
    """The fault a block recorded before it trapped (persistent_schedule.cuh fault_word), in words; None if none."""
    if word == 0:
        return None
    kind, block, thread = word & 0xFF, (word >> 8) & 0xFFF, (word >> 20) & 0x3FF
    parity, what, seen = (word >> 30) & 1, (word >> 31) & 0xFFFF, (word >> 47) & 0xFFFF
    return (f"block {block} thread {thread}: {FAULT_KINDS.get(kind, f'kind {kind}')} (stage or expert {what}, "
            f"parity {parity}, seen {seen})")


#: The box of w13's map for each way of loading an L1 tile (``PersistentVariant.w13_boxes``), outermost first.
W13_BOXES = {1: (1, 8, 2, 8, 128), 16: (1, 1, 1, 8, 128)}


def w13_view(w13: torch.Tensor, boxes: int = 1) -> torch.Tensor:
    """w13's bytes [E, 2I, H] as the kernel's 5-D tensor map sees them. ``boxes`` 1: [E][I / 8][gate, up][8][H]
    (strides 2IH, 8H, IH, H, 1), whose 1 x 8 x 2 x 8 x 128 box lands as 8 groups of 8 gate rows then the 8 up rows of
    the same intermediate columns - one copy an L1 tile, if the driver takes strides out of their dimensions' order;
    16: [E][gate, up][I / 8][8][H] (w13's own order), 16 boxes of 8 rows that the kernel places alike."""
    E, two_i, H = w13.shape
    view = w13.view(torch.uint8).view(E, 2, two_i // 16, 8, H)
    return view.permute(0, 2, 1, 3, 4) if boxes == 1 else view


@dataclass(frozen=True)
class PersistentVariant:
    """One launch configuration: ``stages`` weight stages of 16 KB in flight per SM, ``token_stages`` token stages,
    passes of at most ``tile_cap`` rows (one of :data:`TILE_TOKENS`), the ``claim`` order (:data:`CLAIMS`), ``fused``
    (one launch whose L2 units wait for their expert's L1 units) or an L1 launch then an L2 launch, ``sms`` blocks
    (None: one per SM) and ``w13_boxes`` copies per L1 tile (1 or 16: :func:`w13_view`)."""

    stages: int = 8
    token_stages: int = 4
    tile_cap: int = 64
    claim: str = "strided_experts"
    fused: bool = True
    sms: int | None = None
    w13_boxes: int = 1

    def shared_bytes(self) -> int:
        return shared_bytes(self.stages, self.token_stages, self.tile_cap)

    def check(self, sm_count: int, shared_limit: int) -> None:
        """``ChunkringUsageError`` naming the field the kernel cannot run with on a GPU of ``sm_count`` SMs and
        ``shared_limit`` bytes of shared memory a block may opt in to (:data:`STATIC_SHARED` comes on top)."""
        for name, value, top in (("stages", self.stages, MAX_STAGES), ("token_stages", self.token_stages,
                                                                          MAX_TOKEN_STAGES)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ChunkringUsageError(f"expected an int in [1, {top}], got {value!r}", field=name)
        if self.tile_cap not in TILE_TOKENS:
            raise ChunkringUsageError(f"expected one of {TILE_TOKENS}, got {self.tile_cap!r}", field="tile_cap")
        if self.claim not in CLAIMS:
            raise ChunkringUsageError(f"expected one of {sorted(CLAIMS)}, got {self.claim!r}", field="claim")
        if not isinstance(self.fused, bool):
            raise ChunkringUsageError(f"expected a bool, got {self.fused!r}", field="fused")
        if self.w13_boxes not in W13_BOXES or isinstance(self.w13_boxes, bool):
            raise ChunkringUsageError(f"expected one of {sorted(W13_BOXES)}, got {self.w13_boxes!r}", field="w13_boxes")
        if self.sms is not None and (isinstance(self.sms, bool) or not isinstance(self.sms, int)
                                     or not 1 <= self.sms <= sm_count):
            raise ChunkringUsageError(f"expected None or an int in [1, {sm_count}] (one block per SM, every block "
                                      f"resident at once), got {self.sms!r}", field="sms")
        if self.shared_bytes() + STATIC_SHARED > shared_limit:
            raise ChunkringUsageError(f"{self.stages} weight and {self.token_stages} token stages of {self.tile_cap} "
                                      f"rows need {self.shared_bytes()} bytes of shared memory, the block may have "
                                      f"{shared_limit - STATIC_SHARED}", field="stages")


#: What a layer runs (the decode path of ``MoELayer(decode=...)``): one launch whose L2 units wait for their expert's
#: L1 units, the units handed out in list order from the launch's ticket (the dynamic claim), so that a wait is only
#: ever for units running blocks hold - whether or not every block is resident, which is not so where ranks share a
#: GPU, a partition's pull spins on some SMs, or a caller's kernels run beside the layer's (docs/PERFORMANCE.md, "The
#: decode path").
LAYER_VARIANT = PersistentVariant(claim="dynamic")


#: The architecture the kernel is written for (wgmma and setmaxnreg: sm_90a, Hopper).
PERSISTENT_ARCH = "sm_90"


def check_persistent_config(config: MoEConfig, experts_per_rank: int, arch: str = PERSISTENT_ARCH) -> None:
    """Raise ``ChunkringUsageError`` unless the persistent consumer can run ``config``'s layer with
    ``experts_per_rank`` local experts on a GPU of ``arch`` (:func:`chunkring.jit.compiler.arch_of`): Hopper, the FP8
    payload, ``hidden`` and ``intermediate`` multiples of 128, at most :data:`MAX_EXPERTS` local experts."""
    if arch != PERSISTENT_ARCH:
        raise ChunkringUsageError(f"the persistent consumer runs on {PERSISTENT_ARCH} (Hopper's wgmma), this GPU is "
                                  f"{arch}", field="decode")
    if not config.payload.has_scales:
        raise ChunkringUsageError("the persistent consumer runs FP8 GEMMs: it needs the FP8 payload", field="payload")
    for name in ("hidden", "intermediate"):
        if getattr(config, name) % WEIGHT_BLOCK:
            raise ChunkringUsageError(f"must be a multiple of {WEIGHT_BLOCK}, got {getattr(config, name)}", field=name)
    if isinstance(experts_per_rank, bool) or not isinstance(experts_per_rank, int) \
            or not 1 <= experts_per_rank <= MAX_EXPERTS:
        raise ChunkringUsageError(f"expected an int in [1, {MAX_EXPERTS}], got {experts_per_rank!r}",
                                  field="experts_per_rank")


def block_units(counts: list[int], *, hidden: int, inter: int, claim: str, grid: int,
                phases: int = _PHASE_BOTH) -> list[list[tuple[str, int, int]]]:
    """Each block's units in the order it runs them, as persistent_schedule.cuh's Schedule lists and claims them (a
    mirror: the tests check it, the benchmark reports each block's weight bytes from it): ("L1", expert, chunk) or
    ("L2", expert, row block). ``counts``: each local
    expert's rows; ``phases``: the launch's (1: L1 units, 2: L2 units, 3: both). The ``dynamic`` claim's units go to
    whichever block asks first: given as the blocks take them asking in turn (``strided_experts``' shares)."""
    active = [e for e, rows in enumerate(counts) if rows > 0]
    per = {"L1": inter // WEIGHT_BLOCK, "L2": hidden // WEIGHT_BLOCK}
    units: list[tuple[str, int, int]] = []
    for gemm, bit in (("L1", _PHASE_L1), ("L2", _PHASE_L2)):
        if not phases & bit:
            continue
        for within in range(len(active) * per[gemm]):
            slot, block = ((within % len(active), within // len(active)) if claim == "strided_blocks"
                           else (within // per[gemm], within % per[gemm]))
            units.append((gemm, active[slot], block))
    if claim == "blocked":
        return [units[len(units) * b // grid:len(units) * (b + 1) // grid] for b in range(grid)]
    return [units[b::grid] for b in range(grid)]


class PersistentGemm:
    """The persistent decode consumer for one layer at one rank: :meth:`__call__` enqueues L1 (+ SwiGLU + FP8
    quantisation) and L2 on a plan, as :class:`DecodeGemm` does, in one launch (or two: ``fused=False``).

    Args:
        kernels: the library of device/kernels/moe_persistent.cu (``library_for(runtime, "moe_persistent")``).
        config: the layer's config: the FP8 payload, ``hidden`` and ``intermediate`` multiples of 128.
        experts_per_rank: E_local, at most :data:`MAX_EXPERTS`.
        variant: the default launch configuration (a call may name another).
        wait_limit_ns: how long any of the kernel's waits may take before it records a fault (:meth:`fault`) and
            traps. Under a static claim the L2 units' waits for other blocks' L1 units need every block resident, so
            nothing else may hold the SMs the launch counts on; under the dynamic claim they do not.

    Launches of one PersistentGemm must not overlap (they share its L1 -> L2 counters): enqueue them on one stream.

    Raises:
        ChunkringUsageError: a config or variant the kernel cannot run.
    """

    def __init__(self, kernels: KernelLibrary, config: MoEConfig, experts_per_rank: int, *,
                 variant: PersistentVariant | None = None, wait_limit_ns: int = DEFAULT_WAIT_LIMIT_NS) -> None:
        check_persistent_config(config, experts_per_rank)
        if isinstance(wait_limit_ns, bool) or not isinstance(wait_limit_ns, int) or wait_limit_ns < 1:
            raise ChunkringUsageError(f"expected a positive int, got {wait_limit_ns!r}", field="wait_limit_ns")
        self.kernels, self.config, self.experts_per_rank = kernels, config, experts_per_rank
        self.wait_limit_ns = wait_limit_ns
        props = kernels.runtime.device.properties
        self.sm_count = int(props.multiprocessor_count)
        self.shared_limit = int(props.max_shared_memory_per_block_optin)
        self.variant = variant if variant is not None else PersistentVariant()
        self.variant.check(self.sm_count, self.shared_limit)
        device = kernels.runtime.torch_device
        # sync[e]: expert e's L1 units done in a launch, sync[E]: blocks done, sync[E + 1]: the dynamic claim's
        # ticket; zeros now, and the kernel's last block zeroes them again for the next launch.
        self.sync = torch.zeros(experts_per_rank + 2, dtype=torch.int32, device=device)
        # Host memory, which a trap leaves readable: the kernel's fault word (fault_of).
        self.fault_word = torch.zeros(1, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self._maps: OrderedDict[TiledArguments, bytes] = OrderedDict()

    def __repr__(self) -> str:
        c = self.config
        return (f"PersistentGemm(experts_per_rank={self.experts_per_rank}, hidden={c.hidden}, "
                f"intermediate={c.intermediate}, variant={self.variant})")

    def fault(self) -> str | None:
        """What a block of an earlier launch waited for before it trapped (read after the CUDA error), or None."""
        return fault_of(int(self.fault_word[0]))

    def grid(self, variant: PersistentVariant | None = None) -> int:
        """Blocks of a launch: one per SM, or ``variant.sms``."""
        v = variant if variant is not None else self.variant
        return v.sms if v.sms is not None else self.sm_count

    def check(self, plan: PlanTensors, w13: Fp8Weight, w2: Fp8Weight, out: torch.Tensor) -> None:
        """Raise ``ChunkringUsageError`` unless the plan has the layout the copy engine needs - uint8 rows,
        contiguous rows and scales, the scales' rows whole 16 bytes (P % 4 == 0) from a 16-byte boundary - and the
        weights, the plan and ``out`` have this layer's shapes (:func:`~chunkring.moe._engine.decode.check_plan_gemm`,
        as the decode kernels take them)."""
        P = plan.rows.shape[0]
        if plan.rows.dtype != torch.uint8 or not plan.rows.is_contiguous() or not plan.rows_sf.is_contiguous():
            raise ChunkringUsageError(f"expected contiguous uint8 rows and scales, got {plan.rows.dtype} rows",
                                      field="plan")
        if P % 4 or plan.rows_sf.data_ptr() % 16:
            raise ChunkringUsageError(f"the plan's scales must start on 16 bytes and P ({P}) be a multiple of 4: the "
                                      "copy engine copies whole 16 bytes", field="plan")
        check_plan_gemm(self.experts_per_rank, self.config, plan, w13, w2, out)

    def tensor_map(self, tensor: torch.Tensor, box: tuple[int, ...]) -> TensorMap:
        """A 128-byte-swizzled tensor map of ``tensor`` (a uint8 view), from the cache when an earlier one had the
        same address, shape, strides and box (kept by arguments, not by tensor: no tensor is held alive)."""
        args = tiled_arguments(address=tensor.data_ptr(), dtype="uint8", shape=tuple(tensor.shape),
                               strides=tuple(tensor.stride()), box=box, swizzle="128B")
        data = self._maps.get(args)
        if data is None:
            data = encode_arguments(args)
            self._maps[args] = data
            if len(self._maps) > _MAP_CACHE:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(args)
        return TensorMap(data, tensor.device, tuple(tensor.shape), box, "128B", tensor)

    def __call__(self, plan: PlanTensors, w13: Fp8Weight, w2: Fp8Weight, out: torch.Tensor, *,
                 stream: torch.cuda.Stream | None = None, variant: PersistentVariant | None = None,
                 timeline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Enqueue on ``stream`` (None: the current one) ``out[p] = w2[e] @ act(w13[e] @ row p)`` for every real row p
        of ``plan`` (bf16 [P, H]; other rows untouched), act = e4m3(silu(gate) * up) per 1x128. Returns the activation
        it wrote (``act`` e4m3 [P, I], ``act_sf`` fp32 [I / 128, P]: the groups' real rows), as moe_decode_l1 writes it.
        ``timeline``: int64 [blocks, TIMELINE_WORDS], each block's device times (fused variants only), or None. No
        host synchronisation: graph-capturable (a captured launch keeps the tensor maps of the tensors it was captured
        with). A dependent launch: it may start while the kernel ahead on ``stream`` ends, and reads what that kernel
        writes only after it ended (moe_persistent.cu, "Dependent launch")."""
        v = variant if variant is not None else self.variant
        if v is not self.variant:
            v.check(self.sm_count, self.shared_limit)
        self.check(plan, w13, w2, out)
        grid = self.grid(v)
        if timeline is not None and (timeline.dtype != torch.int64 or tuple(timeline.shape) != (grid, TIMELINE_WORDS)):
            raise ChunkringUsageError(f"expected int64 [{grid}, {TIMELINE_WORDS}], got {timeline.dtype} "
                                      f"{list(timeline.shape)}", field="timeline")
        if timeline is not None and not v.fused:  # each launch writes every word of its blocks' records
            raise ChunkringUsageError("a split call's L2 launch would overwrite its L1 launch's records: time a fused "
                                      "variant", field="timeline")
        E, H, inter = self.experts_per_rank, self.config.hidden, self.config.intermediate
        P = plan.rows.shape[0]
        act = torch.empty((P, inter), dtype=torch.float8_e4m3fn, device=out.device)
        act_sf = torch.empty((inter // WEIGHT_BLOCK, P), dtype=torch.float32, device=out.device)
        w13_map = self.tensor_map(w13_view(w13.data, v.w13_boxes), W13_BOXES[v.w13_boxes])
        w2_map = self.tensor_map(w2.data.view(torch.uint8).view(E * H, inter), (WEIGHT_BLOCK, _KBLOCK))
        rows_map = self.tensor_map(plan.rows, (8, _KBLOCK))
        act_map = self.tensor_map(act.view(torch.uint8), (8, _KBLOCK))
        for phases in ((_PHASE_BOTH,) if v.fused else (_PHASE_L1, _PHASE_L2)):
            self.kernels.launch(
                "moe_persistent_gemm", w13_map=w13_map, w2_map=w2_map, rows_map=rows_map, act_map=act_map,
                args=PersistentGemmArgs(
                    w13_sf=w13.scale, w2_sf=w2.scale, rows_sf=plan.rows_sf, act_sf=act_sf, counts=plan.counts,
                    group_end=plan.group_end, experts=E, hidden=H, inter=inter, sf_stride=P, act=act, out=out,
                    sync=self.sync, stages=v.stages, token_stages=v.token_stages, tile_cap=v.tile_cap,
                    claim=CLAIMS[v.claim], phases=phases, w13_boxes=v.w13_boxes, wait_limit_ns=self.wait_limit_ns,
                    fault_record=self.fault_word.data_ptr(), timeline=timeline),
                grid=grid, block=PERSISTENT_THREADS, shared_bytes=v.shared_bytes(), pdl=True, stream=stream)
        return act, act_sf

    def with_variant(self, **change: Any) -> PersistentVariant:
        """The default variant with ``change`` applied, checked for this GPU."""
        v = replace(self.variant, **change)
        v.check(self.sm_count, self.shared_limit)
        return v
