"""What one MoE layer holds at one rank, made and freed in one place.

:class:`LayerResources` allocates, in a fixed order that every rank follows, the layer's kernel libraries,
its rings (a one-slot batch-ready ring, and the streaming ring when the config has one), the stage the pull
writes into, the combine buffer consumers push into, the expert work's buffers, the incremental block pool
and the SM partition with its streams - and frees them in reverse order. Construction is all or nothing, on
every rank alike: the steps that can fail on one rank only (a kernel build, DeepGEMM's import, a green
context, a grid that does not fit) run first and the ranks agree on their outcome before any collective
allocation; the rank's own buffers and streams (which can run out of memory on one rank) come after the last
collective allocation, and the ranks agree on them too. So a rank never waits in an allocation its peers left,
and every rank frees what was made in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringError, ChunkringRuntimeError, ChunkringUsageError
from chunkring.jit import library_for
from chunkring.jit.compiler import arch_of
from chunkring.moe._engine.blocks import BlockPool, pool_shape
from chunkring.moe._engine.call import CallMode
from chunkring.moe._engine.decode import decode_fits
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe._engine.persistent import LAYER_VARIANT, PersistentGemm, check_persistent_config
from chunkring.moe._engine.producer import PRODUCE_MAX_BLOCKS, produce_grid_limit
from chunkring.moe._engine.stage import Stage
from chunkring.moe.config import MoEConfig
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.moe.kernels import LayerKernels
from chunkring.partition import DEFAULT_PARTITION, PRODUCER_SM_SHARE, SmPartition
from chunkring.ring.ring import Ring
from chunkring.ring.transport import Transport
from chunkring.runtime import TEARDOWN_WAIT_S

if TYPE_CHECKING:
    from chunkring.ring.spec import RingSpec
    from chunkring.runtime import Runtime

__all__ = ["PULL_BLOCK", "PULL_GRID", "LayerResources", "agree", "spinning_grids"]

#: Blocks of the pull kernel at most: each copies a share of every chunk. A few suffice to keep up with
#: the producers; more would only spin, waiting for chunks, on SMs the producers could use.
PULL_GRID = 16
PULL_BLOCK = 256


def spinning_grids(consumer_sms: int, pull_blocks_per_sm: int, producer_sms: int | None,
                   gpu_ranks: int) -> tuple[int, int]:
    """(pull grid, fused producer's most blocks) of a streamed call on the consumer's ``consumer_sms`` SMs and
    the producers' ``producer_sms`` (None: no partition, both on the consumer's), ``gpu_ranks`` ranks sharing
    them (docs/PROTOCOL.md, "Progress" 8). One rank per GPU: the measured grids, every pull block resident.
    Several: one SM per spinning block within the rank's share of each side, one SM of each share left to
    the other kernels (GEMMs, drain); without a partition the pull takes at most half of it."""
    if gpu_ranks == 1:
        return min(PULL_GRID, consumer_sms * pull_blocks_per_sm), PRODUCE_MAX_BLOCKS
    free = consumer_sms // gpu_ranks - 1
    if producer_sms is not None:
        return min(PULL_GRID, max(1, free)), produce_grid_limit(producer_sms, gpu_ranks)
    pull = min(PULL_GRID, max(1, free // 2))
    return pull, produce_grid_limit(consumer_sms, gpu_ranks, pull)


def agree(runtime: Runtime, step: Callable[[], None]) -> None:
    """Run ``step`` here, then raise on every rank if it raised on any: the ranks' next collective happens on
    all of them or on none. The error names every rank that failed and why (a ``ChunkringUsageError`` if
    each failure was one, else a ``ChunkringRuntimeError``); a rank whose step succeeded raises it too."""
    failure: tuple[str, str] | None = None
    error: BaseException | None = None
    try:
        step()
    except Exception as exc:
        error, failure = exc, (type(exc).__name__, str(exc))
    failures = {rank: f for rank, f in enumerate(runtime.allgather_object(failure)) if f is not None}
    if not failures:
        return
    if error is not None and len(failures) == 1:
        raise error  # this rank alone failed: its own error, unchanged
    kind = ChunkringUsageError if all(name == "ChunkringUsageError" for name, _ in failures.values()) \
        else ChunkringRuntimeError
    reasons = "; ".join(f"rank {rank}: {name}: {message}" for rank, (name, message) in failures.items())
    raise kind(f"the layer could not be built on every rank ({reasons})") from error


def auto_decode(config: MoEConfig, world_size: int, arch: str) -> bool | str:
    """What ``decode="auto"`` is on a GPU of ``arch``: "auto", or False (DeepGEMM's path for every call) where the
    decode path cannot run the layer (:func:`~chunkring.moe._engine.persistent.check_persistent_config`: not Hopper,
    not FP8, shapes or experts it does not take)."""
    try:
        check_persistent_config(config, config.num_experts // world_size, arch)
    except ChunkringUsageError:
        return False
    return "auto"


class LayerResources:
    """Everything a :class:`~chunkring.moe.layer.MoELayer` holds at this rank (see the module's docstring).
    A collective to construct and to :meth:`free`: every rank passes the same arguments (the layer checks).

    Attributes: ``kernels``; ``rings`` {mode: :class:`Ring`}; ``transports`` (per PE, the same for every ring);
    ``stage``; ``arrivals`` {mode: int32 [W, S]} (the pull's blocks done with each (source, slot)'s chunk);
    ``produce_arrivals`` {mode: int32 [1]} (the fused producer's blocks done with the chunk); ``combine`` bf16
    [N·K, H] (symmetric: consumers push into it); ``peer_combine`` int64 [W] (each DIRECT source's combine buffer as
    this GPU addresses it, 0 for RMA ones); ``compute`` (:class:`ExpertCompute`); ``pool`` (:class:`BlockPool` or
    None: ``waves > 1`` only) and ``pull_stream`` (where its pull runs); ``partition`` (where streamed calls run, or
    None); ``pull_grid``; ``spinning_produce_blocks`` (the fused producer's most blocks where it may wait for a
    slot); ``streams`` {mode: (producer, consumer)}; ``compute_streams`` {mode: where the expert work after the pull
    runs - an ordinary stream over the whole GPU}; ``consumer_sms`` {mode: SMs the GEMMs on the consumer stream may
    fill (the waves of ``waves > 1``), None for all}; ``decode`` (True: every call's FP8 expert GEMMs on the
    decode path; "auto": each call's as :meth:`decode_for` says; False: DeepGEMM's).
    """

    def __init__(self, runtime: Runtime, config: MoEConfig, *, partition: SmPartition | str = DEFAULT_PARTITION,
                 timeout_s: float | None = None, kernels: LayerKernels | None = None,
                 decode: bool | str = False) -> None:
        self.runtime, self.config = runtime, config
        self.decode = auto_decode(config, runtime.world_size, arch_of(runtime.device)) if decode == "auto" else decode
        self._owned = contextlib.ExitStack()  # frees what was made, in reverse order
        try:
            agree(runtime, lambda: self._prepare(kernels, partition))
            self._allocate(timeout_s)
        except BaseException:
            self._owned.close()
            raise

    def decode_for(self, tokens: int) -> bool:
        """Whether this rank's call of ``tokens`` tokens runs its FP8 expert GEMMs on the decode path: as
        :attr:`decode` says, and for "auto" as :func:`chunkring.moe._engine.decode.decode_fits` says of the call's
        size (this rank's count, as if every rank brought as many: each rank chooses for its own consumer)."""
        if self.decode == "auto":
            return decode_fits(self.config, self.runtime.world_size, tokens=tokens)
        return bool(self.decode)

    # ------------------------------------------------------------------ construction

    def _prepare(self, kernels: LayerKernels | None, partition: SmPartition | str) -> None:
        """The steps that can fail on one rank alone: kernel builds, the GEMM engine (DeepGEMM's, the decode
        path's as :attr:`decode` says, or both), the partition, the grids."""
        runtime, config = self.runtime, self.config
        world, device = runtime.world_size, runtime.torch_device
        self.experts_per_rank = config.num_experts // world
        self.first_expert = runtime.rank * self.experts_per_rank
        self.kernels = kernels if kernels is not None else LayerKernels.build(runtime)
        # The decode path: the persistent consumer, as a layer runs it (LAYER_VARIANT).
        decode_gemm = (PersistentGemm(library_for(runtime, "moe_persistent"), config, self.experts_per_rank,
                                      variant=LAYER_VARIANT) if self.decode else None)
        self.compute = ExpertCompute(config, world, self.first_expert, self.experts_per_rank, self.kernels.experts,
                                     device, decode=decode_gemm, deep_gemm_too=self.decode == "auto")
        # Every block of the pull resident at once, on the consumer's SMs: a block that cannot start would
        # stall the others (docs/PROTOCOL.md, "Progress").
        pulls = ("moe_pull", "moe_pull_blocks") if config.incremental else ("moe_pull",)
        resident = min(self.kernels.stream.resident_blocks_per_sm(name, PULL_BLOCK) for name in pulls)
        if partition == DEFAULT_PARTITION and config.streaming:
            # Reserved for what spins: with one wave only the pull runs there (the GEMMs follow it on the whole
            # GPU), so the producers get the rest; the waves of waves > 1 run their GEMMs there too.
            share = PRODUCER_SM_SHARE if config.incremental else None
            partition = SmPartition.shared(runtime, PULL_GRID, resident, share=share)
        self.partition = partition if isinstance(partition, SmPartition) else None
        consumer_sms = (self.partition.consumer_sms if self.partition is not None
                        else torch.cuda.get_device_properties(device).multi_processor_count)
        # Ranks sharing this GPU spin on the same SMs: each sizes its spinning grids to its share of them.
        self.pull_grid, self.spinning_produce_blocks = spinning_grids(
            consumer_sms, resident, None if self.partition is None else self.partition.plan.producer_sms,
            runtime.gpu_ranks)

    def _allocate(self, timeout_s: float | None) -> None:
        """The collective allocations, in the same order on every rank; then this rank's own buffers and streams,
        whose outcome the ranks agree on, so that a rank out of memory there fails every rank alike (each frees
        its collective allocations in the same order) instead of freeing them while its peers allocate."""
        runtime, config = self.runtime, self.config
        world = runtime.world_size
        specs = {CallMode.BATCH_READY: config.ring_spec(world, streamed=False)}
        if config.streaming:
            specs[CallMode.STREAMED] = config.ring_spec(world, streamed=True)
        self.rings: dict[CallMode, Ring] = {}
        for mode, spec in specs.items():
            self.rings[mode] = self._owned.enter_context(
                Ring(runtime, spec, timeout_s=timeout_s, transport=config.transport))
        # Every ring's buffer lives in the same symmetric heap, so NVSHMEM maps a peer for all or none.
        self.transports = self.rings[CallMode.BATCH_READY].transports
        # Where any rank reads or writes a peer by RMA, the local ends of its gets and puts (the stage, the
        # experts' output) are symmetric allocations (Ring.rma_anywhere, agreed by every rank).
        rma_anywhere = self.rings[CallMode.BATCH_READY].rma_anywhere
        if rma_anywhere and config.incremental:
            # The pool is not NVSHMEM-registered (yet), and an RMA get's local buffer must be off-node. Every rank
            # has the same verdict, so every rank raises here.
            raise ChunkringUsageError("waves > 1 (incremental expert blocks) needs every peer DIRECT for now",
                                      field="waves")
        if rma_anywhere:
            self.stage = self._new_stage(self._symmetric)
        # One bf16 row per (token, k) of this rank's batch; consumers write into it from their GPUs, and the
        # reduction over k accumulates in fp32 (bf16 is the output's precision: a wider row buys nothing).
        self.combine = self._symmetric((config.max_tokens_per_rank * config.topk, config.hidden), torch.bfloat16)
        if rma_anywhere:
            self.compute.rma_out = self._symmetric((self.compute.capacity, config.hidden), torch.bfloat16)
        agree(runtime, lambda: self._allocate_own(specs, rma_anywhere))

    def _allocate_own(self, specs: dict[CallMode, RingSpec], rma_anywhere: bool) -> None:
        """This rank's own buffers (no collective): the stage where no peer is reached by RMA, the arrival counts,
        the peers' combine addresses, the block pool, the streams."""
        config, device = self.config, self.runtime.torch_device
        world = self.runtime.world_size
        if not rma_anywhere:
            self.stage = self._new_stage(None)
        self.arrivals = {mode: torch.zeros((world, spec.num_slots), dtype=torch.int32, device=device)
                         for mode, spec in specs.items()}
        self.produce_arrivals = {mode: torch.zeros(1, dtype=torch.int32, device=device) for mode in specs}
        direct = [self.runtime.peer_address(self.combine, pe) if t is Transport.DIRECT else 0
                  for pe, t in enumerate(self.transports)]
        self.peer_combine = torch.tensor(direct, dtype=torch.int64, device=device)
        self.pool: BlockPool | None = None
        if config.incremental:
            self.pool = BlockPool(pool_shape(config.max_tokens_per_rank, config.topk, world, self.experts_per_rank,
                                             GROUP_ALIGN), config.hidden, config.payload.has_scales, device)
        self._streams_for_modes()

    def _new_stage(self, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None) -> Stage:
        return Stage.allocate(self.config, self.runtime.world_size, self.runtime.torch_device,
                              expert_lo=self.first_expert, expert_hi=self.first_expert + self.experts_per_rank,
                              alloc=alloc)

    def _symmetric(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled symmetric tensor (a collective), freed with the layer."""
        tensor = self.runtime.alloc(shape, dtype)
        self._owned.callback(self.runtime.free, tensor)
        return tensor

    def _streams_for_modes(self) -> None:
        device = self.runtime.torch_device
        whole = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.streams = {CallMode.BATCH_READY: whole, CallMode.STREAMED: whole}
        # Where the expert work after the pull runs: nothing there spins, so it takes the whole GPU - the
        # consumer stream itself, unless that is a partition's.
        self.compute_streams = {CallMode.BATCH_READY: whole[1], CallMode.STREAMED: whole[1]}
        self.consumer_sms: dict[CallMode, int | None] = {CallMode.BATCH_READY: None, CallMode.STREAMED: None}
        self.pull_stream: torch.cuda.Stream | None = None
        if self.partition is not None:
            self.streams[CallMode.STREAMED] = (self.partition.producer_stream, self.partition.consumer_stream)
            self.consumer_sms[CallMode.STREAMED] = self.partition.consumer_sms
            self.compute_streams[CallMode.STREAMED] = torch.cuda.Stream(device)
        if self.pool is not None:  # the incremental pull runs beside the waves, on the consumer's SMs
            self.pull_stream = (self.partition.consumer_side_stream if self.partition is not None
                                else torch.cuda.Stream(device))

    def zero_counts(self) -> None:
        """Zero the layer's arrival counts (the pull's and the fused producer's), on the current stream: after a
        failed call, whose blocks may have arrived without the last one - which zeroes a count - ever coming
        (:meth:`MoELayer.reset`, after its rings' quiesce). A call that ends leaves every count at zero (the
        model checks the pull's: docs/model/ring.pml), so calls do not zero them."""
        for count in (*self.arrivals.values(), *self.produce_arrivals.values()):
            count.zero_()

    # ------------------------------------------------------------------ teardown

    def close(self, timeout_s: float = TEARDOWN_WAIT_S) -> None:
        """Free everything (a collective), by the rule of :meth:`Runtime.quiesce`: wait until no kernel of any
        rank runs and none of their NVSHMEM operations is outstanding (a peer's combine push may still be
        writing into this rank's buffer), then free in reverse order of allocation (the partition is the
        runtime's or the caller's: it stays). A rank that does not come within ``timeout_s`` (default
        :data:`chunkring.runtime.TEARDOWN_WAIT_S`) makes the others raise
        :class:`~chunkring.errors.ChunkringHostTimeoutError` naming it, with nothing freed: the symmetric frees are
        collectives too, which that rank would never join."""
        try:
            self.runtime.quiesce(timeout_s, what="the layer's close()")
        except ChunkringError as exc:
            exc.add_note("nothing was freed: every rank must call close() (end the job to reclaim the memory)")
            raise
        self._owned.close()
