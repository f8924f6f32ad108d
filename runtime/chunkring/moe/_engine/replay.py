"""Eager calls replayed from CUDA graphs (:class:`CallGraphs`): what makes an eager call cost about what its graph
replay costs.

Issuing a call's dozen kernels, its DeepGEMM calls and its stream joins from Python takes the host about a
millisecond at any size, several times a decode call's device time. A CUDA graph replays the same work in one
launch. So an eager call that can be replayed is: the first call of each kind runs directly (and is the call's
output), then its graph is captured once over fixed buffers; later calls of that kind write their token count to the
device (where it differs from the last replay's) and replay. The kernels already read the count from the device
(``num_tokens``), so one graph serves every size up to its bucket: token counts round up to a power of two. A routed
call's graph is rebound to each call's own inputs and output (:mod:`chunkring.moe._engine.rebind`: a parameter set
per node whose inputs or output moved, at most three where a call has one chunk), so such a replay copies nothing;
any other (hidden states, whose router kernel reads every row of the bucket; many chunks; a publish on the
partition's stream, which the driver will not set) copies its inputs into the fixed buffers and its output out. What
makes a kind: the batch (routed rows or hidden states), the mode, the bucket, the chunk size, the GEMM engine and the
weights' (and router's) addresses - the graph reads them where they were at its capture.

A call replays only where nothing it asks for needs the host inside it: no timeline, no device count of the
caller's (``num_tokens``: the caller manages its own graphs), not inside a caller's capture, not a mode's first call
(its warm-up and barrier run directly), a batch of at least one row. A capture that fails leaves its kind on the
direct path, logged: the call it followed has already run.

The graphs of one layer share one memory pool: they never run at once (each replays on the caller's stream after the
previous call), and their inputs and output live outside the pool, in buffers of ``max_tokens_per_rank`` rows.

A layer keeps at most :data:`MAX_GRAPHS` graphs. A model calls its layers in a cycle, and a cycle of more kinds than
that would make a least-recently-used cache miss on every call and capture on every miss. So a full cache makes room
for a new kind only by dropping a graph that is stale - not replayed in the last :data:`STALE_CALLS` replayable calls
(weights that were freed, a size no longer called) - and otherwise runs the new kind directly, capturing nothing: the
kinds it holds keep replaying.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from chunkring.errors import ChunkringRuntimeError
from chunkring.moe._engine.call import Call, HiddenBatch, RoutedBatch
from chunkring.moe._engine.rebind import NotRebindable, Rebinding, rebinding
from chunkring.moe.weights import Fp8Weight
from chunkring.ring.failure import capturing
from chunkring.ring.spec import FP8_SCALE_BLOCK

if TYPE_CHECKING:
    from chunkring.moe._engine.resources import LayerResources
    from chunkring.moe._engine.schedule import CallSchedule
    from chunkring.moe.weights import Weight

__all__ = ["MAX_GRAPHS", "STALE_CALLS", "CallGraphs", "bucket"]

log = logging.getLogger("chunkring")

#: Graphs a layer keeps at most. A model that calls one layer object for several of its layers (each with its own
#: weights) needs one graph per layer and size bucket it uses.
MAX_GRAPHS = 256
#: A graph not replayed in this many replayable calls of its layer is stale: a full cache drops it for a new kind.
STALE_CALLS = 4 * MAX_GRAPHS

Key = tuple[object, ...]


def bucket(n: int, capacity: int) -> int:
    """The rows of the graph that serves a call of ``n`` >= 1 rows: the next power of two, at most ``capacity``."""
    return min(capacity, 1 << (n - 1).bit_length())


def _tensors(weight: Weight) -> tuple[torch.Tensor, ...]:
    return (weight.data, weight.scale) if isinstance(weight, Fp8Weight) else (weight,)


class CallGraphs:
    """The replayed eager calls of one layer (see the module's docstring). ``enabled`` False: every call runs
    directly."""

    def __init__(self, resources: LayerResources, schedule: CallSchedule, *, enabled: bool = True) -> None:
        self.res, self.schedule, self.enabled = resources, schedule, enabled
        self._graphs: OrderedDict[Key, torch.cuda.CUDAGraph] = OrderedDict()  # least recently replayed first
        self._last: dict[Key, int] = {}  # per graph, the replayable call that last replayed or captured it
        self._calls = 0  # replayable calls so far
        self._full_logged = False
        self._rebound: dict[Key, Rebinding] = {}  # the graphs pointed at each call's own tensors
        self._direct: set[Key] = set()  # kinds whose capture failed
        self._inputs: dict[str, tuple[torch.Tensor, ...]] = {}  # per batch kind, the graphs' fixed input buffers
        self._out: torch.Tensor | None = None
        self._count: torch.Tensor | None = None  # int32 [1]: the replayed call's token count
        self._count_holds = 0  # what the last replay wrote there (no kernel writes it): a call of as many skips it
        self._pool: Any = None  # torch.cuda.graph_pool_handle(): made at the first capture
        self._stream: torch.cuda.Stream | None = None  # where the last replay ran

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def rebound(self) -> int:
        """How many of the graphs replay over each call's own tensors (the others copy)."""
        return len(self._rebound)

    def eligible(self, call: Call) -> bool:
        """Whether ``call`` may be replayed from a graph (the module's docstring says when)."""
        return (self.enabled and call.n > 0 and call.timeline is None and call.num_tokens is None
                and self.schedule.is_warm(call.mode) and not capturing())

    def key(self, call: Call) -> Key:
        """What a graph of ``call`` depends on besides its inputs' values."""
        batch = call.batch
        kind = "routed" if isinstance(batch, RoutedBatch) else "hidden"
        router = 0 if isinstance(batch, RoutedBatch) else batch.router_weight.data_ptr()
        weights = tuple(t.data_ptr() for w in (call.w13, call.w2) for t in _tensors(w))
        return (kind, call.mode, bucket(call.n, self.res.config.max_tokens_per_rank), call.chunk, call.decode,
                weights, router)

    def replay(self, call: Call) -> torch.Tensor | None:
        """``call``'s output from its kind's graph, enqueued on the current stream; None where it has none (not
        eligible, or not captured yet: run it directly, then :meth:`capture`)."""
        if not self.eligible(call):
            return None
        self._calls += 1
        key = self.key(call)
        graph = self._graphs.get(key)
        if graph is None:
            return None
        self._graphs.move_to_end(key)
        self._last[key] = self._calls
        stream = torch.cuda.current_stream(self.res.runtime.torch_device)
        if self._stream is not None and stream != self._stream:
            stream.wait_stream(self._stream)  # the last replay read the fixed buffers this call overwrites
        self._stream = stream
        assert self._out is not None and self._count is not None  # made by the capture
        n = call.n
        if n != self._count_holds:
            self._count.fill_(n)
            self._count_holds = n
        rebound = self._rebound.get(key)
        if rebound is not None:
            out = call.out
            if out is None:
                out = torch.empty((n, self.res.config.hidden), dtype=torch.bfloat16, device=self._out.device)
            try:
                rebound.apply((*self._own_tensors(call), out), n)
            except ChunkringRuntimeError as error:  # set once at its capture: not expected; this kind runs directly
                log.warning("chunkring: a %s call's graph of %d rows could not be pointed at a call (%s); calls of "
                            "its kind run directly", call.mode.value, bucket(n, self.res.config.max_tokens_per_rank),
                            error)
                self._drop(key)
                self._direct.add(key)
                return None
            graph.replay()
            return out
        self._load(call)
        graph.replay()
        return self._out[:n].clone() if call.out is None else call.out.copy_(self._out[:n])

    def capture(self, call: Call) -> None:
        """After ``call`` ran directly: capture its kind's graph, for the next call of that kind (nothing when it is
        not eligible or has one already). Nothing runs on the device: the capture only records."""
        if not self.eligible(call):
            return
        key = self.key(call)
        if key in self._graphs or key in self._direct or not self._room(call):
            return
        staged = self._staged(call, bucket(call.n, self.res.config.max_tokens_per_rank))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept: a rebinding reads its nodes
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self.schedule.enqueue(staged)
            graph.instantiate()
        except Exception as exc:  # the call it followed ran directly; so will the next of its kind
            self._direct.add(key)
            log.warning("chunkring: a %s call of %d rows could not be captured for replay (%r); calls of its kind "
                        "run directly", call.mode.value, call.n, exc)
            return
        self._graphs[key] = graph
        self._last[key] = self._calls
        if isinstance(call.batch, RoutedBatch):
            assert self._out is not None  # made by _staged
            inputs = self._buffers(call)
            try:  # at least the rows and the output must move
                self._rebound[key] = rebinding(graph, (*inputs, self._out), staged.n, must_move=(0, len(inputs)))
            except NotRebindable as why:
                log.info("chunkring: a %s call's graph of %d rows copies its tensors (%s)", call.mode.value,
                         staged.n, why)

    def _room(self, call: Call) -> bool:
        """Whether a new kind's graph may be captured: the cache has room, or its least recently replayed graph is
        stale and goes (the module's docstring)."""
        if len(self._graphs) < MAX_GRAPHS:
            return True
        oldest = next(iter(self._graphs))
        if self._calls - self._last[oldest] >= STALE_CALLS:
            self._drop(oldest)
            return True
        if not self._full_logged:
            self._full_logged = True
            log.info("chunkring: a layer holds %d call graphs, each replayed within its last %d replayable calls; "
                     "new kinds of call (a %s call of %d rows first) run directly", len(self._graphs), STALE_CALLS,
                     call.mode.value, call.n)
        return False

    def _drop(self, key: Key) -> None:
        del self._graphs[key], self._last[key]
        self._rebound.pop(key, None)

    def clear(self) -> None:
        """Drop every graph and the buffers they read (before the layer's own buffers are freed)."""
        self._graphs.clear()
        self._last.clear()
        self._rebound.clear()
        self._direct.clear()
        self._inputs.clear()
        self._out = self._count = self._pool = self._stream = None
        self._count_holds = 0

    def _staged(self, call: Call, rows: int) -> Call:
        """``call`` over the fixed buffers: its batch's first ``rows`` rows, its count read from the device, its
        output written into the fixed output."""
        cfg, device = self.res.config, self.res.runtime.torch_device
        if self._out is None:
            N = cfg.max_tokens_per_rank
            self._out = torch.zeros((N, cfg.hidden), dtype=torch.bfloat16, device=device)
            self._count = torch.zeros(1, dtype=torch.int32, device=device)
        batch = call.batch
        inputs = self._buffers(call)
        if isinstance(batch, RoutedBatch):
            x, x_sf, idx, w = inputs
            staged_batch: RoutedBatch | HiddenBatch = RoutedBatch(x[:rows], None if batch.x_sf is None else x_sf[:rows],
                                                                  idx[:rows], w[:rows])
        else:
            staged_batch = dataclasses.replace(batch, hidden=inputs[0][:rows])
        return dataclasses.replace(call, batch=staged_batch, n=rows, out=self._out[:rows], num_tokens=self._count)

    def _buffers(self, call: Call) -> tuple[torch.Tensor, ...]:
        """The fixed input buffers of ``call``'s batch kind, ``max_tokens_per_rank`` rows each (made once)."""
        batch = call.batch
        kind = "routed" if isinstance(batch, RoutedBatch) else "hidden"
        if kind not in self._inputs:
            cfg, device = self.res.config, self.res.runtime.torch_device
            N, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk
            if isinstance(batch, RoutedBatch):
                self._inputs[kind] = (torch.zeros((N, H), dtype=batch.x.dtype, device=device),
                                      torch.zeros((N, H // FP8_SCALE_BLOCK), dtype=torch.float32, device=device),
                                      torch.full((N, K), -1, dtype=torch.int32, device=device),
                                      torch.zeros((N, K), dtype=torch.float32, device=device))
            else:
                self._inputs[kind] = (torch.zeros((N, H), dtype=torch.bfloat16, device=device),)
        return self._inputs[kind]

    @staticmethod
    def _own_tensors(call: Call) -> tuple[torch.Tensor | None, ...]:
        """``call``'s batch tensors in the order of its kind's fixed buffers."""
        batch = call.batch
        if isinstance(batch, RoutedBatch):
            return batch.x, batch.x_sf, batch.topk_idx, batch.topk_weights
        return (batch.hidden,)

    def _load(self, call: Call) -> None:
        """``call``'s batch into the fixed buffers' first ``n`` rows (rows past them the graph's count excludes)."""
        n = call.n
        for buffer, tensor in zip(self._buffers(call), self._own_tensors(call), strict=True):
            if tensor is not None:  # bf16 rows carry no scales
                buffer[:n].copy_(tensor)
