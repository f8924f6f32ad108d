"""The expert-parallel MoE layer: batch-ready by default, streamed on request.

Every rank owns ``num_experts / world_size`` experts and a batch of up to ``max_tokens_per_rank``
tokens. A call runs two streams on each rank:

* producer stream: zero this rank's combine rows; publish the batch into a ring (batch-ready: the
  whole batch as one chunk into a one-slot ring of ``max_tokens_per_rank`` rows - the full per-rank
  input region of today's contract; streamed: chunk by chunk, each as soon as its router / TopK /
  quantisation finished, into the ``front_num_slots`` x ``front_tokens_per_slot`` ring); wait until
  every rank acknowledged every chunk (``moe_drain``); reduce the combine rows over k into the output.
* consumer stream (device/kernels/moe_stream.cu, then :mod:`chunkring.moe.experts`): pull every
  source's chunks as they arrive into a per-call stage at their token index, freeing each slot as soon
  as it is copied; then plan the pulled rows into expert groups, L1 -> SwiGLU -> L2 once per expert
  (FP8 payload: DeepGEMM's FP8 grouped GEMMs on FP8 weights), push the weighted rows to their sources'
  bf16 combine buffers, and acknowledge each source's last chunk, held until then.

Expert work happens once per call, after every source's stream ended, however many chunks arrived:
chunk-local expert groups (computing each chunk as it lands) re-read every active expert's weights
per chunk, which measured 1.5-18x slower than batch-ready at DeepSeek-like shapes
(benchmarks/results/README.md). What streaming overlaps is the producers' work with the pull of the
chunks already published. With ``MoEConfig.waves > 1`` (opt-in: incremental expert blocks, docs/PROTOCOL.md)
the pull instead writes each row into a block of its expert, on a stream of its own, and ``waves`` fixed
launches of expert work on the consumer stream each compute the blocks sealed by then (each expert's
weights read about once per wave that has its blocks); the held acks follow the last wave.

A source's last chunk is acknowledged only after its combine rows landed, so a drained producer knows
its combine buffer is complete: no barrier, no global token count, no host synchronisation. Both modes
share the weights, kernels, stage and output layout; a streamed call differs only in which ring it uses
and how its producers publish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from chunkring.env import module_loading_is_eager
from chunkring.errors import ChunkringError, ChunkringUsageError
from chunkring.moe.blocks import BlockPool, pool_shape
from chunkring.moe.calibrate import DEFAULT_TOLERANCE, StreamingCalibration, calibrate
from chunkring.moe.calls import CallMode, check_forward_args, check_run_args
from chunkring.moe.checkpoint import HF_EXPERT_KEYS, ExpertKeys, load_experts
from chunkring.moe.config import MoEConfig
from chunkring.moe.experts import GROUP_ALIGN, ExpertCompute
from chunkring.moe.op import moe_forward, register_layer
from chunkring.moe.producer import PRODUCE_MAX_BLOCKS, enqueue_produce, produce_grid_limit, router_logits
from chunkring.moe.timeline import Event, Timeline
from chunkring.moe.weights import ExpertWeights, Fp8Weight, init_weights, payload_weights
from chunkring.partition import DEFAULT_PARTITION, SmPartition, check_partition_arg
from chunkring.ring.io import check_tensor, enqueue_publish
from chunkring.ring.ring import Ring, _check_identical
from chunkring.ring.spec import FP8_SCALE_BLOCK
from chunkring.ring.transport import Transport

if TYPE_CHECKING:
    from chunkring.runtime import Runtime

__all__ = ["CallMode", "ChunkedMoE", "MoELayer"]

log = logging.getLogger("chunkring")

#: Enqueues rows [start, end) of a call's batch as the ring's next chunk on the producer stream:
#: (ring, start, end, end_of_stream, valid_tokens, batch_rows, stream).
_Publish = Callable[[Ring, int, int, bool, torch.Tensor | None, int | None, torch.cuda.Stream], None]


class _Stage:
    """What one rank's consumer pulls in a call, from either ring: every source's rows at their token
    index (``N = max_tokens_per_rank`` rows per source), and the pull's bookkeeping."""

    def __init__(self, config: MoEConfig, world_size: int, device: torch.device,
                 alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
        """``alloc(shape, dtype)`` (a zero-filled tensor): where the pulled rows land - NVSHMEM's symmetric
        heap when a source is read by RMA (a get's local buffer must be registered off-node)."""
        W, N, H, K = world_size, config.max_tokens_per_rank, config.hidden, config.topk
        fp8 = config.payload.has_scales

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return alloc(shape, dtype) if alloc is not None else torch.zeros(shape, dtype=dtype, device=device)

        self.x = zeros((W, N, H), torch.float8_e4m3fn if fp8 else torch.bfloat16)
        # bf16 rows carry no scales: an empty tensor, which no get reaches (and the symmetric heap holds none).
        self.sf = (zeros((W, N, H // FP8_SCALE_BLOCK), torch.float32) if fp8
                   else torch.zeros((W, N, 0), dtype=torch.float32, device=device))
        # -1 (planned nowhere) is refilled before every pull: a row no chunk brought is never computed.
        self.idx = zeros((W, N, K), torch.int32).fill_(-1)
        self.w = zeros((W, N, K), torch.float32)
        self.symmetric = tuple(t for t in (self.x, self.sf, self.idx, self.w) if t.numel()) if alloc is not None else ()
        # Per source: the seq of its last chunk, whose acknowledgement waits for the combine (-1: none).
        self.held = torch.full((W,), -1, dtype=torch.int64, device=device)


#: How long a layer's first call of a mode waits at the host barrier for every rank's GEMM warm-up: several
#: ranks compiling DeepGEMM's kernels at once take minutes at most; a rank that raised before the barrier
#: never comes, and the others then raise instead of waiting for ever.
FIRST_CALL_BARRIER_S = 900.0

#: Blocks of the pull kernel at most: each copies a share of every chunk. A few suffice to keep up with
#: the producers; more would only spin, waiting for chunks, on SMs the producers could use.
PULL_GRID = 16
_PULL_BLOCK = 256


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


class MoELayer:
    """The layer's symmetric buffers and its two call modes. A collective to construct: every rank
    passes an identical :class:`MoEConfig` (checked).

    ``partition``: where streamed calls run. ``"auto"`` (the default): on a layer with a streaming ring, a
    green-context :class:`chunkring.SmPartition` the layer makes and closes, sized by
    :func:`chunkring.partition.default_producer_sms` - a streamed call's consumer runs beside its producers
    and is the side confined (docs/PROTOCOL.md, "Progress"); an ``SmPartition``: that one (the caller
    closes it, after :meth:`destroy`); ``"none"``: ordinary streams. With ``waves > 1`` (incremental expert
    blocks) a streamed call's pull runs on the partition's second consumer stream, beside the waves.
    Batch-ready calls always run on two ordinary streams over the whole GPU, and always compute the batch
    plan (``waves`` applies to streamed calls): their producers finish before any consumer needs them.
    ``timeout_s``: the rings' watchdog limit.
    ``variant``: the ``CHUNKRING_MUTANT`` value the layer's kernels (ring and experts) are compiled with - 0,
    the real protocol; tests build deliberately broken variants (:mod:`chunkring.testing.stress` names
    them) to show that they catch what each rule prevents.

    Call with the batch already routed (today's MegaMoE contract) - :meth:`run` - or with hidden states
    and a router, so the layer's own producers route, quantise and publish - :meth:`forward`. Either
    call returns bfloat16 [n, H] and is stream-ordered after torch's current stream; neither waits on
    the host. Errors found on the device (timeouts, bad metadata) are raised by :meth:`check`. For a
    model that ``torch.compile`` traces, :func:`chunkring.moe.op.moe_forward` / ``moe_run`` make the same
    calls as one PyTorch operator each (:attr:`handle` names the layer to them).
    """

    def __init__(self, runtime: Runtime, config: MoEConfig, *, partition: SmPartition | str = DEFAULT_PARTITION,
                 timeout_s: float | None = None, variant: int = 0) -> None:
        if not isinstance(config, MoEConfig):
            raise ChunkringUsageError(f"expected a MoEConfig, got {type(config).__name__}", field="config")
        check_partition_arg(partition)
        world = runtime.world_size
        if config.num_experts % world:
            raise ChunkringUsageError(f"{config.num_experts} experts do not split evenly over {world} ranks",
                                      field="num_experts")
        specs = {CallMode.BATCH_READY: config.ring_spec(world, streamed=False)}
        if config.streaming:
            specs[CallMode.STREAMED] = config.ring_spec(world, streamed=True)
        if isinstance(variant, bool) or not isinstance(variant, int) or variant < 0:
            raise ChunkringUsageError(f"must be a non-negative int, got {variant!r}", field="variant")
        if not module_loading_is_eager():
            raise ChunkringUsageError(
                "CUDA loads modules lazily in this process, which can deadlock a producer and a consumer "
                "that spin on each other; set CUDA_MODULE_LOADING=EAGER before CUDA initialises (import "
                "chunkring before torch touches the GPU, or use chunkring-launch)", field="CUDA_MODULE_LOADING")
        _check_identical(runtime, config)
        self.runtime, self.config = runtime, config
        self.experts_per_rank = config.num_experts // world
        self.first_expert = runtime.rank * self.experts_per_rank
        device = runtime.torch_device
        from chunkring._jit import library_for

        self._kernels = library_for(runtime, "moe_stream", defines={"CHUNKRING_MUTANT": variant} if variant else None)
        self.rings = {mode: Ring(runtime, spec, timeout_s=timeout_s, transport=config.transport)
                      for mode, spec in specs.items()}
        # Every ring's buffer lives in the same symmetric heap, so NVSHMEM maps a peer for all or none.
        self.transports = self.rings[CallMode.BATCH_READY].transports
        # Where any rank reads or writes a peer by RMA, the local ends of its gets and puts (the stage, the
        # experts' output) must be NVSHMEM-registered: symmetric allocations, a collective, so decided alike.
        self._rma_anywhere = any(runtime.allgather_object(Transport.RMA in self.transports))
        self._stage = _Stage(config, world, device, runtime.alloc if self._rma_anywhere else None)
        # Per ring, per (source, slot): the pull's blocks done with the current chunk (ring.cuh finish_chunk).
        self._arrivals = {mode: torch.zeros((world, spec.num_slots), dtype=torch.int32, device=device)
                          for mode, spec in specs.items()}
        # Per ring: the fused producer's blocks done with the current chunk (ring.cuh last_block_to_arrive).
        self._produce_kernels = library_for(runtime, "moe_produce")
        self._produce_arrivals = {mode: torch.zeros(1, dtype=torch.int32, device=device) for mode in specs}
        # Every block of the pull resident at once, on the consumer's SMs: a block that cannot start
        # would stall the others (docs/PROTOCOL.md, "Progress").
        pulls = ("moe_pull", "moe_pull_blocks") if config.incremental else ("moe_pull",)
        resident = min(self._kernels.resident_blocks_per_sm(name, _PULL_BLOCK) for name in pulls)
        self._own_partition = None
        if partition == DEFAULT_PARTITION and config.streaming:
            partition = self._own_partition = SmPartition.sized_for(runtime, PULL_GRID, resident)
        confined = self._partition = partition if isinstance(partition, SmPartition) else None
        consumer_sms = confined.consumer_sms if confined is not None else torch.cuda.get_device_properties(
            device).multi_processor_count
        # Ranks sharing this GPU spin on the same SMs: each sizes its spinning grids to its share of them.
        self._pull_grid, streamed_producer = spinning_grids(
            consumer_sms, resident, None if confined is None else confined.plan.producer_sms, runtime.gpu_ranks)
        # A batch-ready call's producer never waits (one chunk per source, the ring drained): its whole grid.
        self._produce_max_blocks = {CallMode.BATCH_READY: PRODUCE_MAX_BLOCKS, CallMode.STREAMED: streamed_producer}
        # One bf16 row per (token, k) of this rank's batch; consumers write into it from their GPUs, and the
        # reduction over k accumulates in fp32 (bf16 is the output's precision: a wider row buys nothing).
        self.combine = runtime.alloc((config.max_tokens_per_rank * config.topk, config.hidden), torch.bfloat16)
        # Each DIRECT source's combine buffer as this GPU addresses it (moe_combine_push stores there); 0 for
        # an RMA source, which the push reaches by a put to self.combine's symmetric address instead.
        direct = [runtime.peer_address(self.combine, pe) if t is Transport.DIRECT else 0
                  for pe, t in enumerate(self.transports)]
        self._peer_combine = torch.tensor(direct, dtype=torch.int64, device=device)
        self._compute = ExpertCompute(config, world, self.first_expert, self.experts_per_rank,
                                      library_for(runtime, "moe_experts",
                                                  defines={"CHUNKRING_MUTANT": variant} if variant else None), device)
        if self._rma_anywhere:
            self._compute.rma_out = runtime.alloc((self._compute.capacity, config.hidden), torch.bfloat16)
        # Incremental expert blocks (config.waves > 1, streamed calls): the pool the pull writes rows into, and
        # the stream the pull runs on, beside the waves on the consumer stream - on the consumer's SMs.
        self._blocks: BlockPool | None = None
        self._pull_stream: torch.cuda.Stream | None = None
        if config.incremental:
            if self._rma_anywhere:
                # An RMA get's local buffer must be NVSHMEM-registered off-node; the pool is not (yet).
                raise ChunkringUsageError("waves > 1 (incremental expert blocks) needs every peer DIRECT for now",
                                          field="waves")
            self._blocks = BlockPool(pool_shape(config.max_tokens_per_rank, config.topk, world,
                                                self.experts_per_rank, GROUP_ALIGN),
                                     config.hidden, config.payload.has_scales, device)
            self._pull_stream = (confined.consumer_side_stream if confined is not None
                                 else torch.cuda.Stream(device))
        log.info("chunkring MoELayer: %s", self.describe_transport())
        self.streaming_calibration: StreamingCalibration | None = None  # what streaming="auto" follows
        # Per mode: (producer, consumer) streams, and the SMs the consumer's GEMMs may fill (None: all).
        whole = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self._streams = {CallMode.BATCH_READY: whole, CallMode.STREAMED: whole}
        self._consumer_sms: dict[CallMode, int | None] = {CallMode.BATCH_READY: None, CallMode.STREAMED: None}
        if confined is not None:
            self._streams[CallMode.STREAMED] = (confined.producer_stream, confined.consumer_stream)
            self._consumer_sms[CallMode.STREAMED] = confined.consumer_sms
        self._warm_modes: set[CallMode] = set()  # modes whose first call ran (warm-up, then the ranks' barrier)
        self._handle = register_layer(self)

    @property
    def handle(self) -> int:
        """The integer that names this layer to the ``chunkring::moe_forward`` / ``chunkring::moe_run``
        operators (:mod:`chunkring.moe.op`), unique in this process and never reused. After
        :meth:`destroy` the operators refuse it as the methods do."""
        return self._handle

    def streams(self, mode: CallMode) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The (producer, consumer) streams a call of ``mode`` runs on: the partition's for a streamed call
        of a partitioned layer, else two ordinary streams over the whole GPU (shared by both modes)."""
        return self._streams[mode]

    @property
    def producer_stream(self) -> torch.cuda.Stream:
        """The stream a streamed call's producers (route, quantise, publish, drain, reduce) run on (see
        :meth:`streams`)."""
        return self._streams[CallMode.STREAMED][0]

    @property
    def consumer_stream(self) -> torch.cuda.Stream:
        """The stream a streamed call's consumer steps (pull, experts, combine push, ack) run on (see
        :meth:`streams`)."""
        return self._streams[CallMode.STREAMED][1]

    @property
    def partition(self) -> SmPartition | None:
        """The partition streamed calls run on (the layer's own with ``partition="auto"``), or None."""
        return self._partition

    def __repr__(self) -> str:
        return f"MoELayer({self.config}, rank {self.runtime.rank} of {self.runtime.world_size})"

    def describe_transport(self) -> str:
        """One line: which sources this rank pulls from (and pushes combine rows to) with loads and stores,
        which by RMA (:attr:`transports`, per PE, the same for every ring of the layer)."""
        return self.rings[CallMode.BATCH_READY].describe_transport()

    # ------------------------------------------------------------------ public calls

    def run(self, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, *, streaming: bool | str = False,
            out: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None,
            timeline: Timeline | None = None) -> torch.Tensor:
        """The layer on a routed batch: x [n, H] (float8_e4m3fn with x_sf float32 [n, H/128], or bfloat16
        with x_sf None, per ``payload``), topk_idx int32 [n, K] (-1 = masked), topk_weights float32 [n, K];
        this rank's experts w13 [E_local, 2I, H] and w2 [E_local, H, I] as :meth:`expert_weights` gives them
        (FP8 payload: :class:`~chunkring.moe.weights.Fp8Weight`, FP8 with 128x128 block scales, fed to FP8
        GEMMs with the rows as published; bf16 payload: bfloat16 tensors). Streamed, the
        batch is published chunk by chunk; either way the output is bfloat16 [n, H] (``out`` if given).
        ``streaming="auto"``: whichever mode :meth:`calibrate` found no slower here (batch-ready until then).

        ``num_tokens`` (int32 [1] on the device, optional): only the first ``num_tokens`` rows are real,
        read on the device when the call runs - so a CUDA graph captured with ``n`` rows replays with any
        count the caller writes there first. Output rows past it are zero; a count outside [0, n] is
        reported by :meth:`check` and clamped.

        ``timeline`` (a :class:`chunkring.Timeline`, optional): the call appends device timestamps of its
        chunk events there (each chunk's production and publish, each pull and acknowledgement, the
        experts, the combine, the drain); off, no kernel records anything.
        """
        self._check_alive()
        mode, n = check_run_args(self.config, self.experts_per_rank, self.runtime.torch_device,
                                 self.streaming_calibration, x, x_sf, topk_idx, topk_weights, w13, w2,
                                 streaming=streaming, out=out, num_tokens=num_tokens, timeline=timeline)

        def publish(ring: Ring, start: int, end: int, eos: bool, valid: torch.Tensor | None, rows: int | None,
                    stream: torch.cuda.Stream) -> None:
            enqueue_publish(ring, x[start:end], None if x_sf is None else x_sf[start:end], topk_idx[start:end],
                            topk_weights[start:end], start, eos, valid, rows, stream)

        return self._invoke(mode, n, publish, w13, w2, out, num_tokens, timeline)

    def forward(self, hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor | Fp8Weight,
                w2: torch.Tensor | Fp8Weight, *, streaming: bool | str = False, out: torch.Tensor | None = None,
                num_tokens: torch.Tensor | None = None, timeline: Timeline | None = None) -> torch.Tensor:
        """The layer with its own producers: per chunk (streamed) or for the whole batch, router GEMM
        (``router_weight`` bfloat16 [E, H]: :func:`chunkring.moe.producer.router_logits`) -> one fused
        kernel: top-k softmax weights, FP8 quantisation (FP8 payload), publish
        (:func:`chunkring.moe.producer.enqueue_produce`).
        ``hidden`` bfloat16 [n, H]; weights, ``num_tokens`` and ``timeline`` as in :meth:`run`;
        returns bfloat16 [n, H]."""
        self._check_alive()
        cfg = self.config
        mode, n = check_forward_args(cfg, self.experts_per_rank, self.runtime.torch_device, self.streaming_calibration,
                                     hidden, router_weight, w13, w2, streaming=streaming, out=out,
                                     num_tokens=num_tokens, timeline=timeline)

        if hidden.data_ptr() % 16:
            hidden = hidden.clone()  # the fused producer loads rows in 8-byte pieces
        arrivals = self._produce_arrivals[mode]

        def publish(ring: Ring, start: int, end: int, eos: bool, valid: torch.Tensor | None, rows: int | None,
                    stream: torch.cuda.Stream) -> None:
            chunk = hidden[start:end]
            logits = router_logits(chunk, router_weight)  # the GEMM chunkring.moe.producer.route runs
            enqueue_produce(ring, self._produce_kernels, logits, chunk, start, eos, valid, rows, arrivals, stream,
                            self._produce_max_blocks[mode])

        return self._invoke(mode, n, publish, w13, w2, out, num_tokens, timeline)

    def expert_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """This rank's experts (w13 [E_local, 2I, H], w2 [E_local, H, I], bfloat16 on the layer's device) in
        the format this layer's GEMMs take: FP8 payload -> :class:`~chunkring.moe.weights.Fp8Weight` pairs
        (128x128 block scales; quantised once here, at load), bf16 payload -> the tensors as given."""
        E, H, inter = self.experts_per_rank, self.config.hidden, self.config.intermediate
        device = self.runtime.torch_device
        check_tensor("w13", w13, (E, 2 * inter, H), torch.bfloat16, device)
        check_tensor("w2", w2, (E, H, inter), torch.bfloat16, device)
        return payload_weights(self.config, w13, w2)

    def load_experts(self, state_dict: Mapping[str, torch.Tensor], *, prefix: str = "",
                     keys: ExpertKeys = HF_EXPERT_KEYS) -> ExpertWeights:
        """This rank's experts from a checkpoint's ``state_dict``, on the layer's device, in the format
        :meth:`expert_weights` returns: :func:`chunkring.moe.checkpoint.load_experts` with this layer's
        config, expert range and rank. ``prefix``: the layer's keys' prefix (``"model.layers.3.mlp."``);
        ``keys``: the key templates (Hugging Face's by default). Not a collective: each rank reads its own
        experts' keys and ignores every other key."""
        self._check_alive()
        return load_experts(state_dict, self.config, first_expert=self.first_expert, count=self.experts_per_rank,
                            prefix=prefix, keys=keys, device=self.runtime.torch_device, rank=self.runtime.rank)

    def check(self) -> None:
        """Raise ``ChunkringRuntimeError`` with the device's diagnostic if any call recorded an error
        (synchronises the device)."""
        for mode, ring in self.rings.items():
            try:
                ring.check()
            except ChunkringError as error:
                error.add_note(f"(the layer's {mode.name.lower().replace('_', '-')} ring)")
                raise

    def set_timeout(self, seconds: float) -> None:
        """The watchdog limit of the calls enqueued after this on the current stream (every ring's; see
        :meth:`chunkring.Ring.set_timeout`). The constructor's ``timeout_s`` or ``CHUNKRING_TIMEOUT_S`` set
        the first one."""
        for ring in self.rings.values():
            ring.set_timeout(seconds)

    def calibrate(self, router_weight: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight,
                  token_counts: Iterable[int], *, iterations: int = 10, warmup: int = 2,
                  tolerance: float = DEFAULT_TOLERANCE) -> StreamingCalibration:
        """Decide what ``streaming="auto"`` calls do on this machine: time :meth:`forward` batch-ready and
        streamed at each of ``token_counts`` (CUDA-graph replays, random hidden states, these weights) and
        stream only if streamed was within ``tolerance`` of batch-ready at every count on every rank
        (:mod:`chunkring.moe.calibrate`). A collective; logs the decision and returns the figures. Until
        a layer is calibrated, ``"auto"`` runs batch-ready."""
        self.streaming_calibration = calibrate(self, router_weight, w13, w2, token_counts, iterations=iterations,
                                               warmup=warmup, tolerance=tolerance)
        if self.runtime.rank == 0:
            log.info("chunkring MoELayer: %s", self.streaming_calibration.describe())
        return self.streaming_calibration

    def reset(self) -> None:
        """Start a new epoch on every ring (a collective; after an error, before calling again)."""
        for ring in self.rings.values():
            ring.reset()

    def memory(self) -> dict[str, int]:
        """Symmetric bytes per rank: the full input region (batch-ready ring), the streaming ring, the
        combine buffer."""
        report = {"full_input_region_bytes": self.rings[CallMode.BATCH_READY].layout.total_bytes,
                  "combine_bytes": self.combine.numel() * self.combine.element_size()}
        if self.config.streaming:
            report["streaming_ring_bytes"] = self.rings[CallMode.STREAMED].layout.total_bytes
        return report

    def stats(self) -> dict[str, int]:
        """What one call of this layer uses at this rank: the pull's blocks (``pull_grid``), a streamed call's
        fused producer's blocks at most (``producer_grid_max``: :func:`spinning_grids`), the expert
        plan's fixed row capacity (``plan_rows``), the streaming ring's chunk size and slots (0 without
        one), the SMs of a streamed call's producer and consumer partitions (0 without one), the waves of
        expert work per call (``waves``) and the incremental block pool's device bytes (``block_pool_bytes``,
        0 with ``waves=1``), and :meth:`memory`'s symmetric bytes."""
        streamed = self.rings.get(CallMode.STREAMED)
        part = self._partition
        return {"pull_grid": self._pull_grid, "producer_grid_max": self._produce_max_blocks[CallMode.STREAMED],
                "plan_rows": self._compute.capacity,
                "producer_sms": part.plan.producer_sms if part else 0, "consumer_sms": part.consumer_sms if part else 0,
                "chunk_tokens": streamed.spec.tokens_per_slot if streamed else 0,
                "ring_slots": streamed.spec.num_slots if streamed else 0, "waves": self.config.waves,
                "block_pool_bytes": self._blocks.nbytes if self._blocks is not None else 0, **self.memory()}

    def pull(self, mode: CallMode = CallMode.STREAMED) -> None:
        """Enqueue the consumer's pull of ``mode``'s ring alone, on the current stream: what benchmarks time
        of the consumer's first step. A real call runs it inside :meth:`run` / :meth:`forward`; alone it
        re-reads the chunks a finished call left in the ring (each source's last chunk, held)."""
        self._check_alive()
        if mode not in self.rings:
            raise ChunkringUsageError(f"this layer has no {mode.value} ring", field="mode")
        self._launch_pull(mode, (None, 0))

    def destroy(self) -> None:
        """Free the symmetric buffers (a collective) and close the partition the layer made."""
        if self._own_partition is not None:
            self._own_partition.close()  # synchronises its streams first
            self._own_partition = None
        for ring in self.rings.values():
            ring.destroy()
        if self.combine is not None:
            for tensor in (*self._stage.symmetric, self._compute.rma_out):
                if tensor is not None:
                    self.runtime.free(tensor)
            self._compute.rma_out = None
            self.runtime.free(self.combine)
            self.combine = None  # type: ignore[assignment]  # destroyed: _check_alive() guards every call

    # ------------------------------------------------------------------ internals

    def _launch_pull(self, mode: CallMode, trace: tuple[torch.Tensor | None, int]) -> None:
        stage, ring = self._stage, self.rings[mode]
        arrivals = self._arrivals[mode] if self._pull_grid > 1 else None  # one block acknowledges chunks itself
        self._kernels.launch("moe_pull", ring.desc, arrivals, stage.held, stage.x.view(torch.uint8), stage.sf,
                             stage.idx, stage.w, self.config.max_tokens_per_rank, self.first_expert,
                             self.first_expert + self.experts_per_rank, *trace, grid=self._pull_grid,
                             block=_PULL_BLOCK, stream=torch.cuda.current_stream(self.runtime.torch_device))

    def _enqueue_waves(self, mode: CallMode, trace: tuple[torch.Tensor | None, int], w13: torch.Tensor | Fp8Weight,
                       w2: torch.Tensor | Fp8Weight, mark: Callable[[Event], None], sms: int | None) -> None:
        """The consumer's incremental expert blocks, from the consumer stream (current): zero the pool's
        words; ``moe_pull_blocks`` on the pull stream; ``waves`` waves on the consumer stream, concurrent
        with the pull (each claim waits for sealed blocks; the last for every stream's
        end); then the consumer joins the pull stream, so ``moe_ack_held`` (after this) reads the held
        seqs the pull wrote and runs after the last wave's combine push."""
        pool, pull_stream, ring = self._blocks, self._pull_stream, self.rings[mode]
        assert pool is not None and pull_stream is not None  # only called with a pool
        consumer = torch.cuda.current_stream(self.runtime.torch_device)
        pool.reset()
        pull_stream.wait_stream(consumer)  # after the resets (here and the call's) and the previous call's last wave
        stage, shape = self._stage, pool.shape
        arrivals = self._arrivals[mode] if self._pull_grid > 1 else None
        self._kernels.launch("moe_pull_blocks", ring.desc, arrivals, stage.held, stage.idx, stage.w, pool.pos,
                             self.config.max_tokens_per_rank, self.first_expert,
                             self.first_expert + self.experts_per_rank, pool.words, shape.blocks_per_expert,
                             shape.blocks, shape.block_m, pool.x, pool.sf, pool.src, pool.token, pool.k, pool.weight,
                             *trace, grid=self._pull_grid, block=_PULL_BLOCK, stream=pull_stream)
        mark(Event.EXPERTS_BEGIN)
        for wave in range(self.config.waves):
            self._compute.wave(pool, w13, w2, self._peer_combine, last=wave == self.config.waves - 1, desc=ring.desc,
                               combine=self.combine, sms=sms)
        mark(Event.EXPERTS_DONE)
        consumer.wait_stream(pull_stream)

    def _check_alive(self) -> None:
        if self.combine is None:
            raise ChunkringUsageError("this MoELayer was destroyed")

    def _invoke(self, mode: CallMode, n: int, publish: _Publish, w13: torch.Tensor | Fp8Weight,
                w2: torch.Tensor | Fp8Weight, out: torch.Tensor | None, num_tokens: torch.Tensor | None,
                timeline: Timeline | None) -> torch.Tensor:
        """Enqueue one call of ``mode`` (its arguments checked)."""
        ring, stage = self.rings[mode], self._stage
        if out is None:
            out = torch.empty((n, self.config.hidden), dtype=torch.bfloat16, device=self.runtime.torch_device)
        cfg, spec = self.config, ring.spec
        K, H, T = cfg.topk, cfg.hidden, spec.tokens_per_slot
        caller = torch.cuda.current_stream(self.runtime.torch_device)
        producer, consumer = self._streams[mode]
        sms = self._consumer_sms[mode]
        producer.wait_stream(caller)
        consumer.wait_stream(caller)
        if mode not in self._warm_modes:
            with torch.cuda.stream(consumer):
                self._compute.warm_up(w13, w2, sms=sms)  # before anything of this call spins (ExpertCompute.warm_up)
            # No rank enqueues anything that spins before every rank has compiled and loaded its GEMM kernels:
            # a peer's first compile takes seconds to minutes (longer than the watchdog under CPU contention),
            # and a module load can wait for kernels already running on the GPU. Every rank makes its first
            # call of a mode at the same call (calls are collective), so this host barrier runs once per mode.
            self.runtime.host_barrier(timeout_s=FIRST_CALL_BARRIER_S)
            self._warm_modes.add(mode)
        # No record_stream on the caller's tensors: the caller's stream waits for both side streams at
        # the end of the call, so its frees (stream-ordered on it) already come after our last use. That
        # also keeps the allocator from ever recording events on a partition's streams, which may be
        # closed before those tensors are freed.
        kernels, me = self._kernels, self.runtime.rank
        trace = (None, 0) if timeline is None else (timeline.buffer, timeline.capacity)

        def mark(event: Event, chunk: int = -1) -> None:
            if timeline is not None:
                kernels.launch("moe_trace_mark", *trace, int(event), me, chunk, block=32,
                               stream=torch.cuda.current_stream())

        starts = list(range(0, n, T)) if n else [0]

        def produce_chunks(chunks: Iterable[int]) -> None:
            with torch.cuda.stream(producer):
                for chunk in chunks:
                    start = starts[chunk]
                    end = min(start + T, n)
                    mark(Event.PRODUCE_BEGIN, chunk)
                    publish(ring, start, end, end == n, num_tokens, None if num_tokens is None else n, producer)
                    mark(Event.PUBLISHED, chunk)

        # Enqueue order (docs/PROTOCOL.md, "Progress"): the chunks that fit the ring first - their publishes
        # never wait - then the consumer, then the rest. Producer work goes ahead of the consumer's spinning
        # pull where it can (partition.py: the work-queue policy), but the host must not stay blocked
        # behind a full launch queue of producer work that waits for acks of a consumer not yet enqueued:
        # an eager call of many chunks would deadlock (64 chunks of 32 tokens did, on the H200).
        first = min(spec.num_slots, len(starts))
        with torch.cuda.stream(producer):
            mark(Event.CALL_BEGIN)
            # Before our first publish: no consumer writes a row of ours before seeing a chunk of ours.
            self.combine[:n * K].zero_()
            self._produce_arrivals[mode].zero_()  # a failed earlier call may have left a count behind
        produce_chunks(range(first))

        with torch.cuda.stream(consumer):
            stage.idx.fill_(-1)
            stage.held.fill_(-1)
            self._arrivals[mode].zero_()  # a failed earlier call may have left counts behind
            self._compute.pushed.zero_()  # the combine pushes' arrivals, which moe_ack_held counts below
            waves = cfg.waves if self._blocks is not None and mode is CallMode.STREAMED else 1
            if waves > 1:
                self._enqueue_waves(mode, trace, w13, w2, mark, sms)
            else:
                self._launch_pull(mode, trace)
                mark(Event.EXPERTS_BEGIN)
                self._compute(stage, w13, w2, self._peer_combine, lambda: mark(Event.EXPERTS_DONE), desc=ring.desc,
                              combine=self.combine, sms=sms)
            mark(Event.COMBINE_DONE)
            push_arrivals = self._compute.push_blocks * waves  # every wave pushes (one: the batch plan)
            kernels.launch("moe_ack_held", ring.desc, stage.held, self._compute.pushed, push_arrivals,
                           *trace, grid=spec.world_size, block=32, stream=consumer)

        produce_chunks(range(first, len(starts)))
        with torch.cuda.stream(producer):
            # The drain spins until every destination acknowledged; started only after this rank's own
            # consumer is done (its held acks sent, so no wait on it is lost), it does not hold an SM
            # through the expert GEMMs, whose persistent grids want every SM (docs/PERFORMANCE.md).
            producer.wait_stream(consumer)
            kernels.launch("moe_drain", ring.desc, block=32, stream=producer)
            mark(Event.DRAINED)
            # Over k in a fixed order, fp32 accumulation: bitwise reproducible, whichever rank wrote a row.
            torch.sum(self.combine[:n * K].view(n, K, H), dim=1, out=out)
            mark(Event.OUTPUT_DONE)

        caller.wait_stream(producer)
        caller.wait_stream(consumer)
        return out


class ChunkedMoE(torch.nn.Module):
    """An ``nn.Module`` over a :class:`MoELayer` that owns the router (bfloat16 [E, H]) and this rank's
    expert weights, in the format the layer's GEMMs take (:meth:`MoELayer.expert_weights`: FP8 with
    128x128 block scales for the FP8 payload, bfloat16 otherwise).

    ``forward(hidden, streaming=False, num_tokens=None)`` routes ``hidden`` bfloat16 [n, H] and returns
    bfloat16 [n, H] (``num_tokens`` as in :meth:`MoELayer.run`): :meth:`MoELayer.forward` as the
    ``chunkring::moe_forward`` operator (:func:`chunkring.moe.op.moe_forward`), so ``torch.compile`` of a
    model holding this module traces it as one op, without a graph break.
    Weights start as :func:`init_weights` draws from ``generator`` (a CPU ``torch.Generator``).
    Its streamed calls run on ``layer``'s partition: by default (``MoELayer(partition="auto")``) one the
    layer sized and made; batch-ready calls keep the whole GPU.
    """

    router_weight: torch.Tensor  # a registered buffer
    w13: torch.Tensor | Fp8Weight
    w2: torch.Tensor | Fp8Weight

    def __init__(self, layer: MoELayer, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise ChunkringUsageError(f"expected a MoELayer, got {type(layer).__name__}", field="layer")
        self.layer = layer
        router, w13, w2 = init_weights(layer.config, generator)
        device = layer.runtime.torch_device
        mine = slice(layer.first_expert, layer.first_expert + layer.experts_per_rank)
        self.register_buffer("router_weight", router.to(device))
        self.w13, self.w2 = layer.expert_weights(w13[mine].to(device), w2[mine].to(device))

    def forward(self, hidden: torch.Tensor, streaming: bool | str = False,
                num_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return moe_forward(self.layer, hidden, self.router_weight, self.w13, self.w2, streaming=streaming,
                           num_tokens=num_tokens)
