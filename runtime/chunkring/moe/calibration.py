"""Measuring what a layer's ``streaming="auto"`` calls do on this machine (:mod:`chunkring.moe.auto` holds
the decision and its rules), and the graph-replay timer the benchmarks share.

Streaming costs each chunk a few kernel launches on the producer side (its router, top-k, quantisation and
publish run per chunk) and saves what the consumer's pulls of earlier chunks overlap; the experts run once
per call either way. Whether that nets out depends on the GPU, the shapes and the chunk size, so the layer
measures instead of guessing: :func:`calibrate` times batch-ready and streamed calls in several chunk
sizes, as CUDA-graph replays at the token counts the caller serves, on every rank.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe.auto import DEFAULT_TOLERANCE, StreamingCalibration

if TYPE_CHECKING:
    from chunkring.moe.layer import MoELayer
    from chunkring.moe.weights import Fp8Weight

__all__ = ["BURST_TOKENS", "MAX_BURST", "burst_for", "calibrate", "capture_graph", "chunk_candidates",
           "replay_median_ms", "replay_medians_ms", "slowest_rank"]

K = TypeVar("K")

log = logging.getLogger("chunkring")


def capture_graph(call: Callable[[], object], load: Callable[[int], object] | None = None) -> torch.cuda.CUDAGraph:
    """``call`` captured in a CUDA graph, after one eager call (every kernel loaded and every lazy torch
    initialisation done before the capture) on the inputs ``load(0)`` puts in place, if given."""
    if load is not None:
        load(0)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


#: A timed sample replays a graph back to back until it covers about this many tokens (at most
#: :data:`MAX_BURST` replays, at least one): a lone sub-millisecond replay measures the idle GPU's ramp and the
#: graph's launch as much as the call, and varied by 5 % between two timings of one call on the H200.
BURST_TOKENS = 2048
MAX_BURST = 16


def burst_for(tokens: int) -> int:
    """Replays per timed sample of a call on ``tokens`` tokens per rank (the same on every rank: a collective's
    replays must pair up): ``BURST_TOKENS // tokens`` within [1, :data:`MAX_BURST`]."""
    return max(1, min(MAX_BURST, BURST_TOKENS // max(tokens, 1)))


def replay_medians_ms(calls: Mapping[K, Callable[[], object]], *, iterations: int, warmup: int, burst: int = 1,
                      barrier: Callable[[], object] | None = None) -> dict[K, float]:
    """Per-call time of each of ``calls`` (the median over ``iterations`` samples): each captured once in a CUDA
    graph (:func:`capture_graph`), then timed in rounds - every round one sample of each call in turn, the order
    rotating, so drift over time (clocks, temperature, other work) falls on every call alike; a sample is
    ``burst`` replays back to back between two CUDA events, divided by ``burst``. The first ``warmup`` rounds
    are not counted. ``barrier()``, if given, runs before each sample so the ranks of a collective call replay
    together; every rank then passes the same calls in the same order, and the same ``burst``."""
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ChunkringUsageError(f"must be an int >= 1, got {burst!r}", field="burst")
    graphs = [(key, capture_graph(call)) for key, call in calls.items()]
    times = _timed_rounds(graphs, iterations=iterations, warmup=warmup, burst=burst, barrier=barrier)
    del graphs  # the last reference: _timed_rounds' own went with its frame
    # The graphs' private pools back to the device: ranks sharing a GPU under MPS allocate from one memory.
    torch.cuda.empty_cache()
    return {key: statistics.median(samples) for key, samples in times.items()}


def _timed_rounds(graphs: list[tuple[K, torch.cuda.CUDAGraph]], *, iterations: int, warmup: int, burst: int,
                  barrier: Callable[[], object] | None) -> dict[K, list[float]]:
    """Each graph's samples after ``warmup`` rounds, as :func:`replay_medians_ms` describes the rounds."""
    times: dict[K, list[float]] = {key: [] for key, _ in graphs}
    for round_ in range(warmup + iterations):
        for offset in range(len(graphs)):
            key, graph = graphs[(round_ + offset) % len(graphs)]
            ms = _sample_ms(graph, burst, barrier)
            if round_ >= warmup:
                times[key].append(ms)
    return times


def replay_median_ms(call: Callable[[], object], load: Callable[[int], object] | None = None, *, iterations: int,
                     warmup: int, barrier: Callable[[], object] | None = None) -> float:
    """Median time of ``call`` captured once in a CUDA graph (:func:`capture_graph`) and replayed
    ``warmup + iterations`` times (the first ``warmup`` not counted), with CUDA events. ``load(i)``, if
    given, refreshes the graph's inputs before replay ``i``; ``barrier()``, if given, runs before each
    replay so the ranks of a collective call replay together. Several calls compared with one another:
    :func:`replay_medians_ms`."""
    graph = capture_graph(call, load)
    times = []
    for i in range(warmup + iterations):
        if load is not None:
            load(i)
        ms = _sample_ms(graph, 1, barrier)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def _sample_ms(graph: torch.cuda.CUDAGraph, burst: int, barrier: Callable[[], object] | None) -> float:
    """One timed sample: the device idle (and the ranks met, with ``barrier``), then ``burst`` replays of
    ``graph`` back to back between two CUDA events; milliseconds per replay."""
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(burst):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / burst


def chunk_candidates(n: int, slot: int, chunks: Iterable[int] | None = None) -> tuple[int, ...]:
    """The chunk sizes worth timing for a streamed call of ``n`` tokens on a ring of ``slot``-token slots: those of
    ``chunks`` (default: the powers of two from 64) below ``n`` and the slot, and the largest possible, ``min(n,
    slot)`` (one chunk where the batch fits a slot)."""
    sizes = chunks if chunks is not None else (1 << k for k in range(6, slot.bit_length() + 1))
    return tuple(sorted({c for c in sizes if c < min(n, slot)} | {min(n, slot)}))


def calibrate(layer: MoELayer, router_weight: torch.Tensor, w13: torch.Tensor | Fp8Weight,
              w2: torch.Tensor | Fp8Weight, token_counts: Iterable[int], *, chunks: Iterable[int] | None = None,
              iterations: int = 10, warmup: int = 2, tolerance: float = DEFAULT_TOLERANCE,
              seed: int = 0) -> StreamingCalibration:
    """Decide what ``layer``'s ``streaming="auto"`` calls do on this machine (:mod:`chunkring.moe.auto`): time
    ``layer.forward`` batch-ready, and streamed in each chunk size of :func:`chunk_candidates`, at each of
    ``token_counts`` (CUDA-graph replays of random hidden states, these weights), agree across ranks on the
    slowest rank's figure of each option, and set ``layer.streaming_calibration``, which ``"auto"`` calls (and
    the chunking of every streamed call) follow from then on. A collective: every rank passes the same counts
    and settings.

    Args:
        layer: a layer with a streaming ring.
        router_weight, w13, w2: as :meth:`MoELayer.forward` takes them.
        token_counts: tokens per rank to measure, each in [1, ``max_tokens_per_rank``]: the sizes the caller
            serves (each call is governed by the smallest of them at or above its own count).
        chunks: chunk sizes to try besides the largest (default: powers of two from 64 up to the slot).
        iterations, warmup: rounds timed, and rounds before them (:func:`replay_medians_ms`: batch-ready and
            every chunking interleaved, :func:`burst_for` replays per sample).
        tolerance: how much slower than batch-ready streaming may measure, at every count, for "auto" to stream.
        seed: the hidden states' seed (with the rank).

    Returns:
        The :class:`StreamingCalibration` (also logged by rank 0).

    Raises:
        ChunkringUsageError: a layer without a streaming ring, or a bad count, chunk size or setting.
    """
    cfg = layer.config
    slot = cfg.stream_slot_tokens
    if slot is None:
        raise ChunkringUsageError("needs a streaming ring (stream_slots, stream_slot_tokens)", field="config")
    counts = tuple(token_counts)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.max_tokens_per_rank
                         for n in counts):
        raise ChunkringUsageError(f"need token counts in [1, {cfg.max_tokens_per_rank}], got {token_counts!r}",
                                  field="token_counts")
    sizes = tuple(chunks) if chunks is not None else None
    if sizes is not None and (not sizes or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= slot
                                               for c in sizes)):
        raise ChunkringUsageError(f"need chunk sizes in [1, {slot}], got {chunks!r}", field="chunks")
    for name, value, low in (("iterations", iterations, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ChunkringUsageError(f"must be an int >= {low}, got {value!r}", field=name)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ChunkringUsageError(f"must be in [0, 1), got {tolerance!r}", field="tolerance")
    runtime = layer.runtime
    gen = torch.Generator(runtime.torch_device).manual_seed(seed * 7919 + runtime.rank)

    batch: dict[int, float] = {}
    streamed: dict[int, dict[int, float]] = {}
    for n in counts:
        hidden = torch.randn(n, cfg.hidden, generator=gen, device=runtime.torch_device).to(torch.bfloat16)
        call = partial(layer.forward, hidden, router_weight, w13, w2)
        options: dict[int | None, Callable[[], object]] = {None: partial(call, streaming=False)}
        options.update({c: partial(call, streaming=True, chunk=c) for c in chunk_candidates(n, slot, sizes)})
        timed = replay_medians_ms(options, iterations=iterations, warmup=warmup, burst=burst_for(n),
                                  barrier=runtime.barrier)
        batch[n] = timed.pop(None)
        streamed[n] = {c: ms for c, ms in timed.items() if c is not None}
    everyone = runtime.allgather_object((batch, streamed))
    layer.streaming_calibration = StreamingCalibration(*slowest_rank(everyone), float(tolerance))
    if runtime.rank == 0:
        log.info("chunkring MoELayer: %s", layer.streaming_calibration.describe())
    return layer.streaming_calibration


def slowest_rank(everyone: list[tuple[dict[int, float], dict[int, dict[int, float]]]]
                 ) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """Every rank's (batch_ms, streamed_ms), in rank order, as one: each option's figure on the rank where it was
    slowest. Identical on every rank (all pass the same list), so every rank makes the same decision."""
    batch = {n: max(ranks[0][n] for ranks in everyone) for n in everyone[0][0]}
    streamed = {n: {c: max(ranks[1][n][c] for ranks in everyone) for c in chunks}
                for n, chunks in everyone[0][1].items()}
    return batch, streamed
