"""The FP8 decode path's rule and its first engine. Which calls take the decode path (:func:`decode_fits`,
:data:`DECODE_MAX_ROWS`) and the operands its engines take (:func:`check_plan_gemm`); :class:`DecodeGemm`, two "swap
AB" GEMM kernels (device/kernels/moe_decode.cu) in place of DeepGEMM's L1, ``moe_swiglu_fp8`` and DeepGEMM's L2, on
the same plan (:class:`~chunkring.moe._engine.experts.DevicePlan`). A layer's decode path runs the persistent
consumer (:mod:`chunkring.moe._engine.persistent`), faster on the H100 at 8 and 128 tokens; the decode kernels are
the baseline the benchmarks and GPU tests compare it with.

Why: at decode sizes (a few rows per expert) DeepGEMM's grouped GEMMs pad every expert to a 128-row
block, and the layer measured ~2x above the time it takes to read the active experts' weights once
from HBM (docs/PERFORMANCE.md). The decode kernels put 16 weight rows on the MMA's wide side and 8
tokens on its narrow side, so an expert's weights are streamed once per pass of up to
:data:`DECODE_PASS_ROWS` of its rows, and an expert with no rows reads nothing.

Which calls take it: a layer built with ``decode=True`` runs every call on it; ``decode="auto"`` chooses per call,
by the call's token count (:func:`decode_fits` with ``tokens``): the decode path while an expert's mean rows are
at most :data:`DECODE_MAX_ROWS`, DeepGEMM's above. The bound follows the newest measurements of the layer on each
engine (see the constant). Both engines are fixed
grids that loop over whatever rows a call brought, so either is correct at any routing and captures into a CUDA
graph; only the speed depends on the rows per expert. Each rank chooses for its own consumer - the choice changes
how it computes its rows, not what the ranks exchange - and a streamed call chooses as the batch-ready call of its
size does, so the two stay equal bit for bit. The engines round differently in their last bits, so a token's
output can differ between a call of 8 tokens and one of 4,096.

Weights are read in the checkpoint's own layout (:class:`~chunkring.moe.weights.Fp8Weight`, [E, N, K]
e4m3 row-major with 128x128 block scales): the kernels choose their k order so that every MMA
fragment comes from 16-byte loads of that layout (:func:`fragment_k`), so there is no transformed copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.kernel_args import DecodeL1Args, DecodeL2Args
from chunkring.moe.weights import WEIGHT_BLOCK, Fp8Weight
from chunkring.ring.io import check_row_aligned

if TYPE_CHECKING:
    from chunkring.jit import KernelLibrary
    from chunkring.moe.config import MoEConfig

__all__ = ["DECODE_MAX_ROWS", "DECODE_PASS_ROWS", "DECODE_SHARED_BYTES", "DECODE_THREADS", "L2_CHUNK_ROWS",
           "DecodeGemm", "PlanTensors", "check_decode_config", "check_plan_gemm", "decode_fits", "fragment_k",
           "mean_rows_per_expert"]

#: An expert's rows per pass over its weights (decode_gemm.cuh kPassRows: 4 token tiles of 8): an expert
#: with more rows streams its weights once per 32 of them.
DECODE_PASS_ROWS = 32
#: Threads per block of both kernels (decode_gemm.cuh kThreads: 8 warps).
DECODE_THREADS = 256
#: Dynamic shared memory per block of both kernels (decode_gemm.cuh kSharedBytes): each warp's ring of 6 k blocks
#: of weight fragments, 4 KiB each, that cp.async keeps in flight ahead of its MMAs.
DECODE_SHARED_BYTES = 8 * 6 * 4096
#: Output rows of w2 per L2 block: 8 warps x 2 m tiles of 16 (two 128-row scale blocks).
L2_CHUNK_ROWS = 2 * WEIGHT_BLOCK
#: The rule's default bound: the decode path is chosen while an expert's mean rows in a call are at most this, the
#: largest size the layer on the persistent consumer measured faster at than on DeepGEMM's path (H100, both engines
#: timed as graph replays in one call: 0.94x at the V3 width's 32 mean rows, 0.86x at flash's 24; even at 48, 1.29x
#: at 64, 1.60x at 96). The records: docs/PERFORMANCE.md, "Choice per call".
DECODE_MAX_ROWS = 32


class PlanTensors(Protocol):
    """What the decode kernels (and the persistent consumer's) read of a plan: :class:`chunkring.moe._engine.experts.
    DevicePlan` is one (a protocol, so that this module, which :mod:`chunkring.moe._engine.experts` imports, need not
    import it back)."""

    @property
    def counts(self) -> torch.Tensor: ...
    @property
    def group_end(self) -> torch.Tensor: ...
    @property
    def rows(self) -> torch.Tensor: ...
    @property
    def rows_sf(self) -> torch.Tensor: ...


def fragment_k(step: int, t: int, half: int, byte: int) -> int:
    """The k (0..127) of a 128-wide k block that a fragment byte holds in both operands of the decode
    kernels' MMAs: MMA step ``step`` (0..3), lane ``t`` = lane % 4, register half ``half`` (0 or 1), byte
    ``byte`` (0..3). Mirrors decode_gemm.cuh ``fragment_k``: lane t's two 16-byte loads of a row's k
    block start at 16t and 64 + 16t; steps 0-1 use the first, 2-3 the second."""
    return (step // 2) * 64 + t * 16 + (step % 2) * 8 + half * 4 + byte


def mean_rows_per_expert(config: MoEConfig, world_size: int, tokens: int | None = None) -> float:
    """An expert's rows under uniform routing when every rank brings ``tokens`` tokens (None: a full batch,
    ``max_tokens_per_rank``), ``topk`` choices each, spread over ``num_experts``."""
    n = config.max_tokens_per_rank if tokens is None else tokens
    return n * world_size * config.topk / config.num_experts


def check_decode_config(config: MoEConfig) -> None:
    """Raise ``ChunkringUsageError`` unless the decode kernels can run ``config``'s layer: the FP8 payload,
    ``hidden`` a multiple of 256 (L2's blocks: two 128-row scale blocks of w2) and ``intermediate`` a
    multiple of 128 (L1's blocks: one scale block of gate and of up rows)."""
    if not config.payload.has_scales:
        raise ChunkringUsageError("the decode path runs FP8 GEMMs: it needs the FP8 payload", field="payload")
    if config.hidden % L2_CHUNK_ROWS:
        raise ChunkringUsageError(f"the decode path needs hidden % {L2_CHUNK_ROWS} == 0, got {config.hidden}",
                                  field="hidden")
    if config.intermediate % WEIGHT_BLOCK:
        raise ChunkringUsageError(f"the decode path needs intermediate % {WEIGHT_BLOCK} == 0, got "
                                  f"{config.intermediate}", field="intermediate")


def decode_fits(config: MoEConfig, world_size: int, *, tokens: int | None = None,
                max_rows: int = DECODE_MAX_ROWS) -> bool:
    """Whether a call of ``tokens`` tokens per rank (None: a full batch) of a layer of ``config`` on ``world_size``
    ranks should take the decode path: the FP8 payload and at most ``max_rows`` rows per expert on average
    (:func:`mean_rows_per_expert`). Whether the decode path can run the layer at all - its engine's rules - the layer
    settles once, before this is asked (``MoELayer(decode="auto")`` falls back to DeepGEMM's path where it cannot).
    A call may still bring an expert many more rows (a hot expert): it is computed correctly, in more passes.
    ``max_rows=0``: only a call without tokens."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ChunkringUsageError(f"expected an int >= 0, got {max_rows!r}", field="max_rows")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        raise ChunkringUsageError(f"expected an int >= 0 or None, got {tokens!r}", field="tokens")
    return config.payload.has_scales and mean_rows_per_expert(config, world_size, tokens) <= max_rows


def check_plan_gemm(experts_per_rank: int, config: MoEConfig, plan: PlanTensors, w13: Fp8Weight, w2: Fp8Weight,
                    out: torch.Tensor) -> None:
    """Raise ``ChunkringUsageError`` unless the FP8 expert GEMMs on a plan (L1 + SwiGLU + L2, writing ``out``) have
    the shapes of ``config``'s layer with ``experts_per_rank`` local experts: contiguous :class:`Fp8Weight` w13
    [E, 2I, H] and w2 [E, H, I] on 16-byte boundaries, the plan's rows [P, H] (on 16 bytes) and scales [H / 128, P],
    its ``counts`` and ``group_end`` [E], ``out`` bf16 [P, H]. What :class:`DecodeGemm` and the persistent consumer
    (:mod:`chunkring.moe._engine.persistent`) both take."""
    E, H, inter = experts_per_rank, config.hidden, config.intermediate
    for name, w, shape in (("w13", w13, (E, 2 * inter, H)), ("w2", w2, (E, H, inter))):
        if not isinstance(w, Fp8Weight):
            raise ChunkringUsageError(f"expected a chunkring.moe.Fp8Weight, got {type(w).__name__}", field=name)
        if tuple(w.data.shape) != shape:
            raise ChunkringUsageError(f"expected data {list(shape)}, got {list(w.data.shape)}", field=name)
        if not w.data.is_contiguous() or not w.scale.is_contiguous():
            raise ChunkringUsageError("data and scale must be contiguous", field=name)
        check_row_aligned(name, w.data)  # the kernels load 16 bytes at a time
    P = plan.rows.shape[0]
    if tuple(plan.rows.shape) != (P, H) or tuple(plan.rows_sf.shape) != (H // WEIGHT_BLOCK, P):
        raise ChunkringUsageError(f"expected FP8 rows [P, {H}] and scales [{H // WEIGHT_BLOCK}, P], got "
                                  f"{list(plan.rows.shape)} and {list(plan.rows_sf.shape)}", field="plan")
    check_row_aligned("plan", plan.rows)
    for name in ("counts", "group_end"):
        shape = tuple(getattr(plan, name).shape)
        if shape != (E,):
            raise ChunkringUsageError(f"expected {name} [{E}], got {list(shape)}", field="plan")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (P, H) or out.dtype != torch.bfloat16:
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ChunkringUsageError(f"expected bfloat16 [{P}, {H}], got {got}", field="out")


class DecodeGemm:
    """The decode path's expert GEMMs for one layer at one rank: :meth:`__call__` enqueues L1 (+ SwiGLU + FP8
    quantisation) and L2 on a plan, writing bf16 rows like the DeepGEMM path.

    Args:
        kernels: the library of device/kernels/moe_decode.cu (``library_for(runtime, "moe_decode")``).
        config: the layer's config (:func:`check_decode_config`).
        experts_per_rank: E_local.

    Raises:
        ChunkringUsageError: a config the kernels cannot run.
    """

    def __init__(self, kernels: KernelLibrary, config: MoEConfig, experts_per_rank: int) -> None:
        check_decode_config(config)
        if isinstance(experts_per_rank, bool) or not isinstance(experts_per_rank, int) or experts_per_rank < 1:
            raise ChunkringUsageError(f"expected a positive int, got {experts_per_rank!r}", field="experts_per_rank")
        self.kernels, self.config, self.experts_per_rank = kernels, config, experts_per_rank

    def __repr__(self) -> str:
        c = self.config
        return (f"DecodeGemm(experts_per_rank={self.experts_per_rank}, hidden={c.hidden}, "
                f"intermediate={c.intermediate}, grids={self.grids()})")

    def grids(self) -> tuple[int, int]:
        """(L1, L2) blocks: one per (local expert, 128 intermediate columns), one per (local expert, 256
        hidden rows). Fixed per layer: the blocks of experts without rows return at once."""
        E, c = self.experts_per_rank, self.config
        return E * (c.intermediate // WEIGHT_BLOCK), E * (c.hidden // L2_CHUNK_ROWS)

    def check(self, plan: PlanTensors, w13: Fp8Weight, w2: Fp8Weight, out: torch.Tensor) -> None:
        """Raise ``ChunkringUsageError`` unless the weights, the plan and ``out`` have this layer's shapes
        (:func:`check_plan_gemm`)."""
        check_plan_gemm(self.experts_per_rank, self.config, plan, w13, w2, out)

    def __call__(self, plan: PlanTensors, w13: Fp8Weight, w2: Fp8Weight, out: torch.Tensor, *,
                 stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue on ``stream`` (None: the current one) ``out[p] = w2[e] @ act(w13[e] @ row p)`` for every
        real row p of ``plan`` (bf16 [P, H]; other rows untouched), act = e4m3(silu(gate) * up) per 1x128.
        No host synchronisation and nothing read back: graph-capturable.

        Both kernels are dependent launches that read ``plan.counts`` before they wait for the kernel ahead of
        them (ptx/dependent_launch.cuh): the counts must be final once that kernel lets L1 start - as they are
        after ``moe_plan_scatter`` or ``moe_wave_gather`` (the plan's own kernels), or after any kernel that does
        not let its dependents start early (only chunkring's releasing kernels do)."""
        self.check(plan, w13, w2, out)
        H, inter = self.config.hidden, self.config.intermediate
        P = plan.rows.shape[0]
        # The DeepGEMM path's layout for the activation (its moe_swiglu_fp8 writes the same tensors).
        act = torch.empty((P, inter), dtype=torch.float8_e4m3fn, device=out.device)
        act_sf = torch.empty((inter // WEIGHT_BLOCK, P), dtype=torch.float32, device=out.device)
        l1, l2 = self.grids()
        self.kernels.launch("moe_decode_l1", args=DecodeL1Args(
            w13=w13.data, w13_sf=w13.scale, sf_stride=P, counts=plan.counts, hidden=H, inter=inter, rows=plan.rows,
            rows_sf=plan.rows_sf, group_end=plan.group_end, act=act, act_sf=act_sf),
            grid=l1, block=DECODE_THREADS, shared_bytes=DECODE_SHARED_BYTES, pdl=True, stream=stream)
        self.kernels.launch("moe_decode_l2", args=DecodeL2Args(
            w2=w2.data, w2_sf=w2.scale, sf_stride=P, counts=plan.counts, hidden=H, inter=inter, act=act,
            act_sf=act_sf, group_end=plan.group_end, out=out),
            grid=l2, block=DECODE_THREADS, shared_bytes=DECODE_SHARED_BYTES, pdl=True, stream=stream)
