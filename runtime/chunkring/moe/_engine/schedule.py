"""One call of the MoE layer at one rank: what runs on which stream, and in which order.

Two streams per call (:attr:`LayerResources.streams`: a streamed call's are its SM partition's):

* producer stream: publish the batch into the call's ring (batch-ready: the whole batch as one chunk into the
  one-slot ring; streamed: chunk by chunk, each as soon as its producers finished); wait until every rank
  acknowledged every chunk (``moe_drain``); reduce the rows of the routed choices over k into the output:
  the combine rows peers pushed, and this rank's own choices where its experts left them (a masked choice's row
  is written by no rank and read by none, so nothing zeroes them). The set-up
  and the chunks that fit the ring run on the whole GPU's producer stream (their publishes never wait); a
  streamed call's later chunks and its drain on its partition's.
* consumer stream: pull every source's chunks as they arrive into the stage at their token index (each
  slot freed as soon as it is copied); plan the rows into expert groups, L1 -> SwiGLU -> L2 once per expert,
  push the weighted rows to their sources' combine buffers (but this rank's own), then acknowledge each source's
  last chunk,
  held until then (``moe_ack_held``). With ``waves > 1`` (streamed calls) the pull instead lands each row in
  a block of its expert, on a stream of its own, and the waves of expert work run beside it.

A source's last chunk is acknowledged only after its combine rows landed, so a drained producer knows its
combine buffer is complete: no barrier, no global token count, no host synchronisation, and every launch
is fixed, so a call captures into a CUDA graph.

A one-rank layer's batch-ready call of routed rows has no peer to hand its rows to or to hear from: it plans them
itself (``moe_local_route``, ``moe_local_scatter``) and runs experts and reduction on the consumer stream alone,
without the ring (docs/PROTOCOL.md, "One rank"). Its streamed calls, and ``forward()``'s fused producer, keep the ring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from chunkring.moe._engine.call import Call, CallMode, RoutedBatch
from chunkring.moe._engine.experts import DevicePlan, EmptyPlan, OwnRows
from chunkring.moe._engine.kernel_args import LocalRouteArgs, LocalScatterArgs
from chunkring.moe._engine.resources import PULL_BLOCK, LayerResources
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.moe.timeline import Event, Timeline
from chunkring.moe.weights import Weight

if TYPE_CHECKING:
    from chunkring.jit import KernelArgs

__all__ = ["FIRST_CALL_BARRIER_S", "CallSchedule"]

#: The most blocks of ``moe_call_reset`` (eight words a thread below that; a grid-stride loop past it) and of
#: ``moe_local_scatter`` (a warp per choice, and eight plan rows' sources a thread, below that).
_MAX_GRID = 1024
#: Threads of ``moe_local_route``'s one block: every choice of a one-rank call counted in shared memory.
_ROUTE_BLOCK = 1024

#: How long a layer's first call of a mode waits at the host barrier for every rank's GEMM warm-up: several
#: ranks compiling DeepGEMM's kernels at once take minutes at most; a rank that raised before the barrier
#: never comes, and the others then raise instead of waiting for ever.
FIRST_CALL_BARRIER_S = 900.0


class _Marks:
    """A call's timeline marks (``moe_trace_mark`` on the current stream), or nothing without a timeline."""

    def __init__(self, resources: LayerResources, timeline: Timeline | None) -> None:
        self.kernels, self.rank = resources.kernels.stream, resources.runtime.rank
        #: The kernels' trace parameters: the timeline's buffer and capacity (null and 0: no records).
        self.trace: KernelArgs = {"trace": None if timeline is None else timeline.buffer,
                                  "trace_capacity": 0 if timeline is None else timeline.capacity}
        self.on = timeline is not None

    def __call__(self, event: Event, chunk: int = -1) -> None:
        if self.on:
            self.kernels.launch("moe_trace_mark", event=int(event), src=self.rank, chunk=chunk, block=32,
                                stream=torch.cuda.current_stream(), **self.trace)


class CallSchedule:
    """Enqueues calls of one layer on its :class:`LayerResources` (:meth:`enqueue`)."""

    def __init__(self, resources: LayerResources) -> None:
        self.res = resources
        self._warm_modes: set[CallMode] = set()  # modes whose first call ran (warm-up, then the ranks' barrier)
        self._met_barrier = False  # whether the call now being made reached its warm-up barrier (passed or not)

    def enqueue(self, call: Call) -> torch.Tensor:
        """Enqueue ``call`` (resolved and checked) in chunks of ``call.chunk`` rows (None: one chunk), stream-ordered
        after torch's current stream, which waits for it; returns the output, bfloat16 [n, H]."""
        res, mode, n, num_tokens = self.res, call.mode, call.n, call.num_tokens
        ring = res.rings[mode]
        out = call.out
        if out is None:
            out = torch.empty((n, res.config.hidden), dtype=torch.bfloat16, device=res.runtime.torch_device)
        caller = torch.cuda.current_stream(res.runtime.torch_device)
        if ring.spec.world_size == 1 and mode is CallMode.BATCH_READY and isinstance(call.batch, RoutedBatch):
            return self._enqueue_local(call, call.batch, out, caller)
        T = call.chunk if call.chunk is not None else ring.spec.tokens_per_slot
        starts = list(range(0, n, T)) if n else [0]
        waves = res.config.waves if res.pool is not None and mode is CallMode.STREAMED else 1
        # The chunks that fit the ring never wait for a slot, so nothing of theirs spins: they and the call's
        # set-up run on the whole GPU's producer stream. Only the chunks after them, whose publishes wait for
        # acknowledgements, and the drain need the producers' reserved SMs (a streamed call's partition). A call
        # whose chunks all fit (every batch-ready call; a streamed call of at most S chunks at this rank) and
        # whose expert work waits for nothing (one wave) spins only in its pull and its drain, bounded grids
        # that leave the producers SMs: it runs on the whole GPU's streams (docs/PROTOCOL.md, "Progress" 9).
        early = res.streams[CallMode.BATCH_READY][0]
        placed = CallMode.BATCH_READY if waves == 1 and len(starts) <= ring.spec.num_slots else mode
        producer, consumer = res.streams[placed]
        compute = res.compute_streams[placed]
        for stream in {early, producer, consumer}:
            stream.wait_stream(caller)
        self.warm_up(mode, consumer, call.w13, call.w2)
        # No record_stream on the caller's tensors: the caller's stream waits for every stream of the call at its
        # end, so its frees (stream-ordered on it) already come after our last use. That also keeps
        # the allocator from ever recording events on a partition's streams, which may be closed before those
        # tensors are freed.
        mark = _Marks(res, call.timeline)

        def produce_chunks(chunks: Iterable[int], stream: torch.cuda.Stream, *, may_wait: bool) -> None:
            with torch.cuda.stream(stream):
                for index in chunks:
                    start = starts[index]
                    end = min(start + T, n)
                    mark(Event.PRODUCE_BEGIN, index)
                    call.batch.publish(ring, start, end, end == n, num_tokens, None if num_tokens is None else n,
                                       stream, may_wait)
                    mark(Event.PUBLISHED, index)

        # Enqueue order (docs/PROTOCOL.md, "Progress" 10): streams share the GPU's hardware queues, which run
        # their commands in the order the host enqueued them, so no wait on a kernel that spins may be enqueued
        # before the work that kernel waits for. Hence: the chunks that fit the ring (their publishes never wait);
        # the pull; the later chunks (whose publishes wait for the pull's acks); only then the expert work, which
        # waits for the pull to end (or, with waves, claims what it pulled), and the drain, which waits for the
        # held acks. The host never blocks on a full launch queue of later chunks either: the pull is enqueued.
        first = min(ring.spec.num_slots, len(starts))
        with torch.cuda.stream(early):
            mark(Event.CALL_BEGIN)
        produce_chunks(range(first), early, may_wait=False)
        if producer is not early:
            producer.wait_stream(early)  # the later chunks in seq order, and the drain after every publish
        with torch.cuda.stream(consumer):
            last, plan = self._start_pull(mode, mark, waves, compute)
        produce_chunks(range(first, len(starts)), producer, may_wait=True)
        with torch.cuda.stream(consumer):
            own = self._experts_and_acks(mode, call.w13, call.w2, mark, waves, last, plan, call.decode)
        with torch.cuda.stream(producer):
            self._drain_and_reduce(mode, out, mark, last, own)
        if own is not None:
            # own's memory was allocated on `last`: freed when this returns, reused there only after the reduction.
            last.wait_stream(producer)
        caller.wait_stream(producer)
        caller.wait_stream(consumer)
        caller.wait_stream(last)
        return out

    def _enqueue_local(self, call: Call, batch: RoutedBatch, out: torch.Tensor, caller: torch.cuda.Stream
                       ) -> torch.Tensor:
        """A one-rank layer's batch-ready call of routed rows (docs/PROTOCOL.md, "One rank"): its routing into the stage
        and its rows straight into the plan (:meth:`_plan_local`: the publish's and the pull's checks, without the
        ring's round trip), the expert GEMMs and the reduction over k, one chain on the consumer stream. Every choice
        is this rank's own, so nothing is pushed, acknowledged or drained: no kernel of the call waits for another, and
        stream order is all the ordering. The consumer stream (the layer's, not the caller's) keeps calls made from
        different streams from sharing the stage and the plan at once."""
        res, mode = self.res, CallMode.BATCH_READY
        consumer = res.streams[mode][1]
        consumer.wait_stream(caller)
        self.warm_up(mode, consumer, call.w13, call.w2)
        mark = _Marks(res, call.timeline)
        with torch.cuda.stream(consumer):
            mark(Event.CALL_BEGIN)
            plan = self._plan_local(call, batch, mark, consumer)
            rows = res.compute.experts(plan, call.w13, call.w2, decode=call.decode)
            mark(Event.EXPERTS_DONE)
            mark(Event.COMBINE_DONE)  # nothing pushed: the reduction reads every row where the experts left it
            mark(Event.DRAINED)  # nothing to wait for
            self._reduce(mode, out, OwnRows(plan.own_row, rows))
            mark(Event.OUTPUT_DONE)
        caller.wait_stream(consumer)
        return out

    def _plan_local(self, call: Call, batch: RoutedBatch, mark: _Marks, stream: torch.cuda.Stream) -> DevicePlan:
        """A one-rank call's plan, two launches on ``stream`` (the current one): ``moe_local_route`` (one block: the
        routing, checked, into the stage rows the reduction reads, and the plan but its payload: each choice's row
        in its group) then ``moe_local_scatter`` (a dependent launch: each local choice's payload into its row,
        checked; the rows past the last group padding) - what a reset, a publish, a pull and the plan's count and
        scatter leave."""
        res, n = self.res, call.n
        ring, stage, compute = res.rings[CallMode.BATCH_READY], res.stage, res.compute
        E, K = compute.experts_per_rank, res.config.topk
        plan = compute.plan_buffers(stage)
        P = plan.src.shape[0]
        mark(Event.PRODUCE_BEGIN, 0)
        res.kernels.stream.launch("moe_local_route", args=LocalRouteArgs(
            desc=ring.desc, stage=stage.desc, topk_idx=batch.topk_idx, topk_weights=batch.topk_weights, n_tokens=n,
            valid_tokens=call.num_tokens, block_m=GROUP_ALIGN, counts=plan.counts, group_end=plan.group_end,
            row_src=plan.src, row_token=plan.token, row_k=plan.k, row_weight=plan.weight, own_row=plan.own_row),
            grid=1, block=_ROUTE_BLOCK, shared_bytes=4 * (2 * E + 1), stream=stream)
        mark(Event.PUBLISHED, 0)
        mark(Event.EXPERTS_BEGIN)
        # A warp per choice; the rows past the last group (at most all P) eight to a thread.
        res.kernels.stream.launch("moe_local_scatter", args=LocalScatterArgs(
            desc=ring.desc, stage=stage.desc, x=batch.x.view(torch.uint8), x_sf=batch.x_sf, n_tokens=n,
            valid_tokens=call.num_tokens, block_m=GROUP_ALIGN, group_end=plan.group_end, own_row=plan.own_row,
            rows=plan.rows, rows_sf=plan.rows_sf, sf_stride=P, plan_rows=P, row_src=plan.src),
            grid=max(1, min(_MAX_GRID, max(-(-n * K // (PULL_BLOCK // 32)), -(-P // (8 * PULL_BLOCK))))),
            block=PULL_BLOCK, pdl=True, stream=stream)
        return plan

    def _reset_call_words(self, stream: torch.cuda.Stream) -> None:
        """``moe_call_reset`` on ``stream``: the stage's routing (-1) and held seqs and the pushes' count (which
        moe_ack_held counts), whatever an earlier call left, in one launch."""
        res = self.res
        choices = res.stage.idx.numel()
        res.kernels.stream.launch("moe_call_reset", stage=res.stage.desc, pushed=res.compute.pushed,
                                  grid=max(1, min(_MAX_GRID, -(-choices // (8 * PULL_BLOCK)))), block=PULL_BLOCK,
                                  stream=stream)

    def is_warm(self, mode: CallMode) -> bool:
        """Whether ``mode``'s first call ran: until then, a call of it meets every rank at its warm-up barrier."""
        return mode in self._warm_modes

    def begin_call(self) -> None:
        """A new call starts (the layer's entry, before its checks): it has not reached a warm-up barrier yet."""
        self._met_barrier = False

    def owes_first_barrier(self, mode: CallMode) -> bool:
        """Whether the call being made is ``mode``'s first and has not reached its warm-up barrier: its peers wait
        there for this rank, which must abandon it if the call fails (once reached, the barrier's own verdict -
        passed, or raised on every rank - settles it)."""
        return mode not in self._warm_modes and not self._met_barrier

    def warm_up(self, mode: CallMode, consumer: torch.cuda.Stream, w13: Weight, w2: Weight) -> None:
        """The first call of ``mode``: load the GEMM engine's kernels before anything of this call spins
        (:meth:`ExpertCompute.warm_up`: for the whole GPU, and for the consumer's SMs where waves run there),
        then wait at a host barrier for every rank's."""
        if mode in self._warm_modes:
            return
        # A build that fails here only (a compile error, out of memory) raises before the barrier: the layer's call
        # then abandons it (MoELayer._collective_call, owes_first_barrier), so the peers waiting there raise at once.
        with torch.cuda.stream(consumer):
            self.res.compute.warm_up(w13, w2, sms=None)
            if self.res.pool is not None and mode is CallMode.STREAMED:
                self.res.compute.warm_up(w13, w2, sms=self.res.consumer_sms[mode])
        # No rank enqueues anything that spins before every rank has compiled and loaded its GEMM kernels: a
        # peer's first compile takes seconds to minutes (longer than the watchdog under CPU contention), and a
        # module load can wait for kernels already running on the GPU. Every rank makes its first call of a
        # mode at the same call (calls are collective), so this host barrier runs once per mode.
        self._met_barrier = True
        self.res.runtime.host_barrier(timeout_s=FIRST_CALL_BARRIER_S, what=f"the first {mode.value} call's warm-up")
        self._warm_modes.add(mode)

    def _start_pull(self, mode: CallMode, mark: _Marks, waves: int, compute_stream: torch.cuda.Stream
                    ) -> tuple[torch.cuda.Stream, EmptyPlan | None]:
        """The consumer's first part, from the consumer stream (current): the call's resets and the pull (with
        ``waves > 1``, ``moe_pull_blocks`` on the pull stream). Nothing here waits for the pull. Returns the stream
        the expert work and the held acks run on (:meth:`_experts_and_acks`) and the batch plan, reset (None with
        waves).

        Only the pull waits for other kernels (for chunks producers have not published yet), so only the pull
        runs on the consumer stream - on a partition, the SMs reserved for what spins (docs/PROTOCOL.md,
        "Progress"). Once it returns every source's chunks are in, and the rest - plan, GEMMs, combine push,
        held acks - runs on ``compute_stream`` over the whole GPU (the consumer stream itself where that is the
        whole GPU's). With ``waves > 1`` the waves' claims spin beside the pull, so every wave stays on the
        consumer stream."""
        res = self.res
        compute = res.compute
        consumer = torch.cuda.current_stream(res.runtime.torch_device)
        self._reset_call_words(consumer)
        if waves > 1:
            self._pull_into_blocks(mode, mark)
            return consumer, None
        if compute_stream is not consumer:
            compute_stream.wait_stream(consumer)  # after the call's start (in a capture: the stream joins the graph)
        # The plan's reset does not depend on the pull: enqueued before it, it runs while the chunks are still
        # coming, not between the pull and the GEMMs. On the stream that uses the plan: one stream allocates, uses
        # and frees its buffers.
        with torch.cuda.stream(compute_stream):
            plan = compute.empty_plan()
        self._launch_pull(mode, mark.trace)
        return compute_stream, plan

    def _experts_and_acks(self, mode: CallMode, w13: Weight, w2: Weight, mark: _Marks, waves: int,
                          last: torch.cuda.Stream, plan: EmptyPlan | None, decode: bool) -> OwnRows | None:
        """The consumer's second part, from the consumer stream (current), enqueued after every publish of the
        call: the expert work (``decode``: its FP8 GEMMs on the decode path) into ``plan``, combine push and held
        acks, on ``last`` (:meth:`_start_pull`). Returns where the batch plan left this rank's own choices (None with
        waves, which push every row)."""
        res = self.res
        ring, stage, compute = res.rings[mode], res.stage, res.compute
        consumer = torch.cuda.current_stream(res.runtime.torch_device)
        own = None
        if waves > 1:
            self._waves(w13, w2, mark, res.consumer_sms[mode], decode, ring.desc)
        else:
            if last is not consumer:
                last.wait_stream(consumer)  # after the pull: every chunk of every source is in the stage
            with torch.cuda.stream(last):
                mark(Event.EXPERTS_BEGIN)
                own = compute(stage, w13, w2, res.peer_combine, lambda: mark(Event.EXPERTS_DONE), desc=ring.desc,
                              combine=res.combine, sms=None, decode=decode, empty=plan)
        with torch.cuda.stream(last):
            mark(Event.COMBINE_DONE)
            push_arrivals = compute.push_blocks * waves  # every wave pushes (one: the batch plan)
            res.kernels.stream.launch("moe_ack_held", desc=ring.desc, stage=stage.desc, pushed=compute.pushed,
                                      push_blocks=push_arrivals, grid=ring.spec.world_size, block=32, stream=last,
                                      pdl=True, **mark.trace)
        return own

    def _launch_pull(self, mode: CallMode, trace: KernelArgs) -> None:
        """Enqueue ``moe_pull`` of ``mode``'s ring into the stage, on the current stream. ``trace``: the
        timeline's kernel parameters (:attr:`_Marks.trace`)."""
        res = self.res
        arrivals = res.arrivals[mode] if res.pull_grid > 1 else None  # one block acknowledges chunks itself
        res.kernels.stream.launch("moe_pull", desc=res.rings[mode].desc, arrivals=arrivals, stage=res.stage.desc,
                                  grid=res.pull_grid, block=PULL_BLOCK,
                                  stream=torch.cuda.current_stream(res.runtime.torch_device), **trace)

    def _pull_into_blocks(self, mode: CallMode, mark: _Marks) -> None:
        """From the consumer stream (current), after the call's reset: zero the pool's words, then
        ``moe_pull_blocks`` on the pull stream, which lands each row in a block of its expert (:meth:`_waves`
        claims them)."""
        res = self.res
        pool, pull_stream, ring, stage = res.pool, res.pull_stream, res.rings[mode], res.stage
        assert pool is not None and pull_stream is not None  # only called with a pool
        consumer = torch.cuda.current_stream(res.runtime.torch_device)
        pool.reset()
        pull_stream.wait_stream(consumer)  # after the resets (here and the call's) and the previous call's last wave
        arrivals = res.arrivals[mode] if res.pull_grid > 1 else None
        res.kernels.stream.launch("moe_pull_blocks", desc=ring.desc, arrivals=arrivals, stage=stage.desc,
                                  pool_desc=pool.desc, grid=res.pull_grid, block=PULL_BLOCK, stream=pull_stream,
                                  **mark.trace)

    def _waves(self, w13: Weight, w2: Weight, mark: _Marks, sms: int | None, decode: bool, desc: torch.Tensor) -> None:
        """``waves`` waves of expert work on the consumer stream (current), concurrent with the pull (each claim
        waits for sealed blocks; the last for every stream's end); then the consumer joins the pull stream, so
        ``moe_ack_held`` (after this) reads the held seqs the pull wrote and runs after the last wave's combine
        push. ``decode``: the waves' FP8 GEMMs on the decode path."""
        res = self.res
        assert res.pool is not None and res.pull_stream is not None  # only called with a pool
        consumer = torch.cuda.current_stream(res.runtime.torch_device)
        mark(Event.EXPERTS_BEGIN)
        for wave in range(res.config.waves):
            res.compute.wave(res.pool, w13, w2, res.peer_combine, last=wave == res.config.waves - 1, desc=desc,
                             combine=res.combine, sms=sms, decode=decode)
        mark(Event.EXPERTS_DONE)
        consumer.wait_stream(res.pull_stream)

    def _drain_and_reduce(self, mode: CallMode, out: torch.Tensor, mark: _Marks, consumed: torch.cuda.Stream,
                          own: OwnRows | None) -> None:
        """The producer's end of a call, on the producer stream (current): drain, then the reduction over k.
        ``consumed``: the stream of this rank's held acks (:meth:`_experts_and_acks`); ``own``: where its experts left
        this rank's own choices (None: pushed to its combine buffer like the others)."""
        res = self.res
        producer = torch.cuda.current_stream(res.runtime.torch_device)
        # The drain spins until every destination acknowledged; started only after this rank's own consumer is
        # done (its held acks sent, so no wait on it is lost), it does not hold an SM through the expert
        # GEMMs, whose persistent grids want every SM (docs/PERFORMANCE.md).
        producer.wait_stream(consumed)
        res.kernels.stream.launch("moe_drain", desc=res.rings[mode].desc, block=32, stream=producer)
        mark(Event.DRAINED)
        # Over k in a fixed order, fp32 accumulation: bitwise reproducible, whichever rank computed a row; zeros where
        # the drain gave up (its error recorded in the ring), since rows may then be another call's. The routing
        # and weights are this rank's own stage rows, which its pull wrote and checked: the held acks (``consumed``)
        # come after the pull in stream order - and after the L2 that wrote the own rows - and the next call's
        # refill of the stage after this reduction.
        self._reduce(mode, out, own)
        mark(Event.OUTPUT_DONE)

    def _reduce(self, mode: CallMode, out: torch.Tensor, own: OwnRows | None) -> None:
        """The reduction over k into ``out``, on the current stream: this rank's own stage routing and weights, the
        combine rows and ``own``, zeros where ``mode``'s ring recorded an error (:meth:`ExpertCompute.reduce`)."""
        res, rank = self.res, self.res.runtime.rank
        res.compute.reduce(res.combine, res.stage.idx[rank], res.stage.w[rank], out, own, desc=res.rings[mode].desc)
