"""The expert-parallel MoE layer: batch-ready by default, streamed on request.

Every rank owns ``num_experts / world_size`` experts and a batch of up to ``max_tokens_per_rank`` tokens.
:class:`MoELayer` resolves each call once (its checks and choices: :mod:`chunkring.moe._engine.call`), then replays
it from a CUDA graph or enqueues it (:mod:`~chunkring.moe._engine.replay`, :mod:`~chunkring.moe._engine.schedule`);
nothing here waits on the host. Expert work happens once per call, after every source's stream ended (with
``MoEConfig.waves > 1``, streamed calls compute in waves instead): what streaming overlaps is the producers' work with
the pull of the chunks already published (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from chunkring.env import check_timeout_s, module_loading_is_eager
from chunkring.errors import ChunkringError, ChunkringUsageError
from chunkring.jit.compiler import arch_of
from chunkring.moe._engine import handles
from chunkring.moe._engine.call import Call, CallMode, Layer, resolve_forward, resolve_mode, resolve_run
from chunkring.moe._engine.persistent import check_persistent_config
from chunkring.moe._engine.replay import CallGraphs
from chunkring.moe._engine.resources import LayerResources
from chunkring.moe._engine.schedule import CallSchedule
from chunkring.moe.config import MoEConfig
from chunkring.moe.kernels import LayerKernels
from chunkring.moe.timeline import Timeline
from chunkring.moe.weights import Fp8Weight
from chunkring.partition import DEFAULT_PARTITION, SmPartition, check_partition_arg
from chunkring.ring.failure import capturing
from chunkring.ring.io import raise_abort
from chunkring.ring.ring import Ring, check_identical
from chunkring.ring.status import ErrorCode
from chunkring.ring.transport import Transport
from chunkring.rollcall import abandoning_on_failure
from chunkring.runtime import TEARDOWN_WAIT_S

if TYPE_CHECKING:
    from chunkring.moe.auto import StreamingCalibration
    from chunkring.runtime import Runtime

__all__ = ["MoELayer"]

log = logging.getLogger("chunkring")


class MoELayer:
    """The layer's symmetric buffers and its two call modes. A collective to construct and to :meth:`close`.

    Args:
        runtime: this process's :class:`chunkring.Runtime` (``chunkring.init()``).
        config: the layer's shapes; every rank passes an identical one (checked).
        partition: where streamed calls of more chunks than the ring's slots run their spinning kernels (a
            call of fewer never waits for a slot and runs on the whole GPU). ``"auto"`` (the default): on a
            layer with a streaming ring, the runtime's shared green-context :class:`chunkring.SmPartition` of its
            size (:meth:`SmPartition.shared`, :func:`chunkring.partition.default_producer_sms`): the consumer is
            the side confined (docs/PROTOCOL.md, "Progress"); an ``SmPartition``: that one (the caller closes it,
            after :meth:`close`); ``"none"``: ordinary streams. Batch-ready calls always run on two ordinary
            streams over the whole GPU, and always compute the batch plan (``waves`` applies to streamed calls).
        timeout_s: the rings' watchdog limit (None: ``CHUNKRING_TIMEOUT_S``, default 100 s).
        kernels: the kernel libraries (None: built for this GPU; :mod:`chunkring.testing.variants` passes
            deliberately broken ones).
        decode: the FP8 expert GEMMs on the decode path (the persistent consumer, Hopper, few rows per expert)
            instead of DeepGEMM's: ``True``: every call; ``"auto"``: each call whose size suits it (at most
            ``DECODE_MAX_ROWS`` rows per expert on average: 32, as measured on the H100); ``False`` (the default):
            never. Streamed and batch-ready calls of one size choose alike, so they stay equal bit for bit.
        eager_graphs: replay eager calls from CUDA graphs, one captured per kind of call after its first
            (:mod:`chunkring.moe._engine.replay`; docs/PERFORMANCE.md, "Eager calls"), holding buffers of
            ``max_tokens_per_rank`` rows and a graph per size, mode and weights. False (the default): no replays.

    Raises:
        ChunkringUsageError: a config that is not a :class:`MoEConfig`, experts that do not split evenly
            over the ranks, a bad ``partition``, lazy CUDA module loading, ranks passing different configs,
            ``waves > 1`` with a peer reached by RMA. Raised on every rank alike, with nothing left allocated
            (lazy loading on one rank alone: its peers raise ``ChunkringHostTimeoutError`` at once, naming it).
        ChunkringRuntimeError: a kernel build, the GEMM engine (DeepGEMM for the FP8 payload) or the SM
            partition failed on some rank: every rank raises, naming each failed rank and why.

    Call with the batch already routed (today's MegaMoE contract) - :meth:`run` - or with hidden states and a
    router, so the layer's own producers route, quantise and publish - :meth:`forward`. Either call returns
    bfloat16 [n, H] and is stream-ordered after torch's current stream; neither waits on the host. An error
    found on the device (a timeout, a peer's abort) fails the layer closed: every later call raises it
    (:meth:`raise_if_failed`, at each call's entry) until :meth:`reset`; :meth:`check` raises it at once,
    masked input too. For a model that ``torch.compile`` traces, :func:`chunkring.moe.op.moe_forward` /
    ``moe_run`` make the same calls as one PyTorch operator each.
    """

    def __init__(self, runtime: Runtime, config: MoEConfig, *, partition: SmPartition | str = DEFAULT_PARTITION,
                 timeout_s: float | None = None, kernels: LayerKernels | None = None,
                 decode: bool | str = False, eager_graphs: bool = False) -> None:
        # Given the same arguments these checks fail alike on every rank. The environment may differ: a rank with
        # lazy module loading abandons the first collective's barrier, so its peers raise at once, naming it.
        if not isinstance(config, MoEConfig):
            raise ChunkringUsageError(f"expected a MoEConfig, got {type(config).__name__}", field="config")
        check_partition_arg(partition, runtime)
        if not (isinstance(decode, bool) or decode == "auto"):
            raise ChunkringUsageError(f"expected True, False or 'auto', got {decode!r}", field="decode")
        if not isinstance(eager_graphs, bool):
            raise ChunkringUsageError(f"expected a bool, got {eager_graphs!r}", field="eager_graphs")
        if kernels is not None and not isinstance(kernels, LayerKernels):
            raise ChunkringUsageError(f"expected LayerKernels or None, got {type(kernels).__name__}", field="kernels")
        config.check_world_size(runtime.world_size)  # every ring rule at this world size, the experts' split
        if decode is True:
            check_persistent_config(config, config.num_experts // runtime.world_size, arch_of(runtime.device))
        with abandoning_on_failure(runtime):
            if not module_loading_is_eager():
                raise ChunkringUsageError(
                    "CUDA loads modules lazily in this process, which can deadlock a producer and a consumer "
                    "that spin on each other; set CUDA_MODULE_LOADING=EAGER before CUDA initialises (import "
                    "chunkring before torch touches the GPU, or use chunkring-launch)", field="CUDA_MODULE_LOADING")
        check_identical(runtime, config)
        self.runtime, self.config = runtime, config
        #: Everything the layer holds at this rank (:class:`LayerResources`): rings, stage, buffers, kernels,
        #: partition and streams.
        self.resources = LayerResources(runtime, config, partition=partition, timeout_s=timeout_s, kernels=kernels,
                                        decode=decode)
        #: This rank's experts: ``experts_per_rank`` of them from global index ``first_expert``.
        self.experts_per_rank, self.first_expert = self.resources.experts_per_rank, self.resources.first_expert
        #: Enqueues the layer's calls on :attr:`resources`.
        self.schedule = CallSchedule(self.resources)
        #: Eager calls replayed from CUDA graphs, one per kind of call (:mod:`chunkring.moe._engine.replay`).
        self._graphs = CallGraphs(self.resources, self.schedule, enabled=eager_graphs)
        #: What ``streaming="auto"`` calls follow (set by :func:`chunkring.calibrate`; None: batch-ready).
        self.streaming_calibration: StreamingCalibration | None = None
        self._closed = False
        self._handle = handles.register(self)
        log.info("chunkring MoELayer: %s", self.describe_transport())

    # ------------------------------------------------------------------ what the layer holds

    @property
    def handle(self) -> int:
        """The integer that names this layer to the ``chunkring::moe_forward`` / ``chunkring::moe_run``
        operators (:mod:`chunkring.moe.op`), unique in this process and never reused. After :meth:`close`
        the operators refuse it as the methods do."""
        return self._handle

    @property
    def rings(self) -> dict[CallMode, Ring]:
        """The layer's rings, by the call mode that uses each."""
        return self.resources.rings

    @property
    def transports(self) -> tuple[Transport, ...]:
        """Per PE: how this rank reaches that PE's slots and combine rows (the same for every ring)."""
        return self.resources.transports

    @property
    def partition(self) -> SmPartition | None:
        """The partition streamed calls run on (the runtime's shared one with ``partition="auto"``), or None."""
        return self.resources.partition

    def streams(self, mode: CallMode) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The (producer, consumer) streams a call of ``mode`` runs on: the partition's for a streamed call
        of a partitioned layer, else two ordinary streams over the whole GPU (shared by both modes)."""
        return self.resources.streams[mode]

    @property
    def producer_stream(self) -> torch.cuda.Stream:
        """The stream a streamed call's producers (route, quantise, publish, drain, reduce) run on."""
        return self.resources.streams[CallMode.STREAMED][0]

    @property
    def consumer_stream(self) -> torch.cuda.Stream:
        """The stream a streamed call's consumer steps (pull, experts, combine push, ack) run on."""
        return self.resources.streams[CallMode.STREAMED][1]

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"MoELayer({self.config}, rank {self.runtime.rank} of {self.runtime.world_size}{state})"

    def describe_transport(self) -> str:
        """One line: which sources this rank pulls from and pushes combine rows to by loads and stores, which by RMA."""
        return self.rings[CallMode.BATCH_READY].describe_transport()

    def memory(self) -> dict[str, int]:
        """Symmetric bytes per rank: the full input region (batch-ready ring), the streaming ring, the
        combine buffer."""
        res = self.resources
        report = {"full_input_region_bytes": res.rings[CallMode.BATCH_READY].layout.total_bytes,
                  "combine_bytes": res.combine.numel() * res.combine.element_size()}
        if self.config.streaming:
            report["streaming_ring_bytes"] = res.rings[CallMode.STREAMED].layout.total_bytes
        return report

    def stats(self) -> dict[str, int]:
        """What one call of this layer uses at this rank: the pull's blocks (``pull_grid``), a streamed call's fused
        producer's blocks at most (``producer_grid_max``), the expert plan's fixed row capacity (``plan_rows``), the
        streaming ring's chunk size and slots (0 without one), the SMs of a streamed call's producer and consumer
        partitions (0 without one), the waves of expert work per call (``waves``) and the incremental block pool's
        device bytes (``block_pool_bytes``, 0 with ``waves=1``), the graphs its eager calls replay (``call_graphs``;
        ``call_graphs_rebound``: over each call's own tensors) and :meth:`memory`'s symmetric bytes."""
        res = self.resources
        streamed = res.rings.get(CallMode.STREAMED)
        part = res.partition
        return {"pull_grid": res.pull_grid, "producer_grid_max": res.spinning_produce_blocks, "plan_rows":
                res.compute.capacity, "call_graphs": len(self._graphs), "call_graphs_rebound": self._graphs.rebound,
                "producer_sms": part.plan.producer_sms if part else 0, "consumer_sms": part.consumer_sms if part else 0,
                "chunk_tokens": streamed.spec.tokens_per_slot if streamed else 0,
                "ring_slots": streamed.spec.num_slots if streamed else 0, "waves": self.config.waves,
                "block_pool_bytes": res.pool.nbytes if res.pool is not None else 0, **self.memory()}

    # ------------------------------------------------------------------ calls

    def run(self, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, *, streaming: bool | str = False,
            out: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None,
            timeline: Timeline | None = None, chunk: int | None = None) -> torch.Tensor:
        """The layer on a routed batch. A collective: every rank calls it, each with its own batch.

        Args:
            x: the rows, [n, H]: float8_e4m3fn for the FP8 payload, bfloat16 for the bf16 payload.
            x_sf: float32 [n, H/128], one scale per 128 elements of a row (FP8 payload); None (bf16).
            topk_idx: int32 [n, K], global expert ids; -1 masks a choice.
            topk_weights: float32 [n, K].
            w13, w2: this rank's experts, [E_local, 2I, H] and [E_local, H, I], as
                :func:`chunkring.moe.weights.expert_weights` gives them (FP8 payload:
                :class:`~chunkring.moe.weights.Fp8Weight` with 128x128 block scales; bf16: bfloat16 tensors).
            streaming: False (batch-ready), True (chunk by chunk through the streaming ring) or ``"auto"``
                (what :attr:`streaming_calibration` decided; batch-ready until calibrated).
            out: bfloat16 [n, H] to write into (None: a new tensor).
            num_tokens: int32 [1] on the device: only the first ``num_tokens`` rows are real, read when the
                call runs, so a CUDA graph captured with ``n`` rows replays with any count the caller writes
                there first. Output rows past it are zero; a count outside [0, n] is reported by
                :meth:`check` and clamped.
            timeline: a :class:`chunkring.Timeline` the call appends device timestamps of its chunk events to.
            chunk: tokens per chunk of a streamed call, in [1, ``stream_slot_tokens``] (None: what
                :attr:`streaming_calibration` measured fastest for ``n`` tokens, else the slot size). Ranks may
                chunk differently. Batch-ready calls publish one chunk whatever it says.

        Returns:
            bfloat16 [n, H] (``out`` if given), stream-ordered after torch's current stream.

        Raises:
            ChunkringUsageError: a bad argument (named), before any of the call is enqueued; a closed layer.
                A bad argument of this rank's own (a tensor, ``chunk``) also aborts the ring its peers may wait
                in (docs/INTEGRATION.md, "Failing closed"): every rank then needs :meth:`reset`.
            ChunkringDeviceError: an earlier call failed on the device (:meth:`raise_if_failed`); its
                subclasses ``ChunkringTimeoutError`` and ``ChunkringPeerAbortedError`` as :meth:`check` says.
        """
        mode = self._mode(streaming)
        with self._collective_call(mode):
            call = resolve_run(self._call_context, mode, x, x_sf, topk_idx, topk_weights, w13, w2, out=out,
                               num_tokens=num_tokens, timeline=timeline, chunk=chunk)
            return self._issue(call)

    def forward(self, hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor | Fp8Weight,
                w2: torch.Tensor | Fp8Weight, *, streaming: bool | str = False, out: torch.Tensor | None = None,
                num_tokens: torch.Tensor | None = None, timeline: Timeline | None = None,
                chunk: int | None = None) -> torch.Tensor:
        """The layer with its own producers: per chunk (streamed) or for the whole batch, the router GEMM
        (:func:`chunkring.moe.routing.router_logits`) then one fused kernel: top-k softmax weights, FP8
        quantisation (FP8 payload), publish (:func:`chunkring.moe._engine.producer.enqueue_produce`). A collective.

        Args:
            hidden: bfloat16 [n, H].
            router_weight: bfloat16 [E, H], every expert's row.
            w13, w2, streaming, out, num_tokens, timeline, chunk: as in :meth:`run`.

        Returns:
            bfloat16 [n, H], stream-ordered after torch's current stream.

        Raises:
            ChunkringUsageError, ChunkringDeviceError: as :meth:`run` raises them.
        """
        mode = self._mode(streaming)
        res = self.resources
        with self._collective_call(mode):
            call = resolve_forward(self._call_context, mode, hidden, router_weight, w13, w2, out=out,
                                   num_tokens=num_tokens, timeline=timeline, chunk=chunk, produce=res.kernels.produce,
                                   arrivals=res.produce_arrivals[mode], spinning_blocks=res.spinning_produce_blocks)
            return self._issue(call)

    @property
    def _call_context(self) -> Layer:
        res = self.resources
        return Layer(self.config, self.experts_per_rank, self.runtime.torch_device, self.streaming_calibration,
                     res.decode_for)

    def _mode(self, streaming: object) -> CallMode:
        """A call's mode, resolved once, before its collective part: the ranks agree on it (each mode has its own
        ring), so a bad ``streaming`` fails every rank alike, as a closed layer does, and aborts nothing."""
        self._check_alive()
        return resolve_mode(self.config, self.streaming_calibration, streaming)

    def _issue(self, call: Call) -> torch.Tensor:
        """Enqueue a resolved call: after :meth:`raise_if_failed`, replayed from its kind's graph where it has one,
        else directly - and then its graph captured for the next call of its kind (:mod:`._engine.replay`)."""
        self.raise_if_failed()
        out = self._graphs.replay(call)
        if out is None:
            out = self.schedule.enqueue(call)
            self._graphs.capture(call)
        return out

    # ------------------------------------------------------------------ errors and lifetime

    def raise_if_failed(self) -> None:
        """Raise the error an earlier call recorded on the device, if one did: what :meth:`check` raises, at the
        cost of one read of a pinned host word per ring when none did (it synchronises only when one did).

        :meth:`run` and :meth:`forward` - so the operators, :class:`chunkring.MoEModule` and the transformers
        drop-in - call it at every entry: an error surfaces at the first call after the failing kernel recorded
        it (:mod:`chunkring.ring.failure`). A CUDA graph replay runs no Python: call this between replays.

        Raises:
            ChunkringTimeoutError, ChunkringPeerAbortedError, ChunkringDeviceError: as :meth:`check`. Inside a
                graph capture, the one the host word names (origin rank, code), without the record's details.
        """
        self._on_every_ring("raise_if_failed", "; reset() to continue")

    @contextlib.contextmanager
    def _collective_call(self, mode: CallMode) -> Iterator[None]:
        """A whole call of ``mode`` - its checks, :meth:`raise_if_failed` and everything it enqueues - as this rank's
        part of a collective. When any of it raises here (a bad argument, a recorded device error, out of memory
        while enqueuing), the peers must learn that this rank will not come, or they would wait for it until a
        limit: before a mode's first call reached its warm-up barrier (:meth:`CallSchedule.owes_first_barrier`)
        they wait there, on the host: this rank abandons it, so they raise at once, naming it; after it, they wait on
        the device: the failure aborts the call's ring (``HOST_USAGE``, :func:`chunkring.ring.io.raise_abort`, which
        sets this rank's failure word at once, so its next call raises). Inside a graph capture nothing is aborted:
        the peers capture too, and wait in nothing yet."""
        self.schedule.begin_call()
        try:
            yield
        except Exception as error:
            if self.schedule.owes_first_barrier(mode):
                self.runtime.abandon_barrier()
            elif self.schedule.is_warm(mode) and not capturing():
                try:
                    raise_abort(self.rings[mode], ErrorCode.HOST_USAGE)
                except Exception as failed:  # the call's error is the one to report; say why peers may wait
                    error.add_note(f"the ring's abort could not be raised ({failed!r}): peers may wait until the "
                                   "watchdog")
            raise

    def check(self) -> None:
        """Raise the first error a call recorded on the device (synchronises the device).

        Raises:
            ChunkringTimeoutError: a device watchdog fired (which wait, on which rank and slot, what it saw).
            ChunkringPeerAbortedError: another rank failed first (``origin_rank``, ``code``).
            ChunkringDeviceError: another protocol error of this rank.
            ChunkringInputError: a consumer masked malformed input (the layer stays usable).
            After the first three the layer needs :meth:`reset` (a collective) before its next call.
        """
        self._on_every_ring("check")

    def _on_every_ring(self, method: str, advice: str = "") -> None:
        """The rings' ``method`` on each (batch-ready first); an error it raises names the ring, then propagates."""
        self._check_alive()
        for mode, ring in self.rings.items():
            try:
                getattr(ring, method)()
            except ChunkringError as error:
                error.add_note(f"(the layer's {mode.name.lower().replace('_', '-')} ring{advice})")
                raise

    def reset(self, *, timeout_s: float | None = None) -> None:
        """Start a new epoch on every ring and zero the layer's arrival counts: after an error, before calling
        again. A collective; each ring's waits for the other ranks bounded by ``timeout_s`` (None: the ring's
        watchdog limit plus a margin, :meth:`chunkring.Ring.reset`)."""
        self._check_alive()
        for ring in self.rings.values():
            ring.reset(timeout_s=timeout_s)
        self.resources.zero_counts()  # after the rings' quiesce: no kernel of the failed call still arrives

    def set_timeout(self, seconds: float) -> None:
        """The watchdog limit of the calls enqueued after this on the current stream (every ring's; see
        :meth:`chunkring.Ring.set_timeout`). The constructor's ``timeout_s`` or ``CHUNKRING_TIMEOUT_S`` set
        the first one."""
        self._check_alive()
        for ring in self.rings.values():
            ring.set_timeout(seconds)

    def close(self, *, timeout_s: float = TEARDOWN_WAIT_S) -> None:
        """Free the layer's buffers and close the partition it made (:meth:`LayerResources.close`). A
        collective; safe at any moment (it waits for this rank's kernels and, at a barrier bounded by ``timeout_s``,
        for every rank's; a rank that does not come makes the others raise ``ChunkringHostTimeoutError`` naming
        it, with nothing freed); a second call does nothing."""
        if self._closed:
            return
        with abandoning_on_failure(self.runtime):  # a bad bound is this rank's own: its peers raise at once
            timeout_s = check_timeout_s(timeout_s, field="timeout_s")
        self._graphs.clear()  # they read the buffers freed next
        self.resources.close(timeout_s)
        self._closed = True

    def __enter__(self) -> MoELayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_alive(self) -> None:
        if self._closed:
            raise ChunkringUsageError("this MoELayer was closed")
