"""Which mode a layer's ``streaming="auto"`` calls take, from measurements on this machine.

Streaming costs each chunk a few kernel launches on the producer side (its router, top-k, quantisation
and publish run per chunk) and saves what the consumer's pulls of earlier chunks overlap; the experts run
once per call either way (chunkring.moe.layer). Whether that nets out depends on the GPU, the shapes and
the chunk size, so the layer measures instead of guessing: :func:`calibrate` times batch-ready and
streamed calls as CUDA-graph replays at the given token counts and streams ``"auto"`` calls only if
streamed was within ``tolerance`` of batch-ready at every count, on every rank. All ranks must take the
same mode in a call (they publish into and pull from one ring), so the choice is one per layer, agreed
collectively - never per call, whose token count differs between ranks.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError

if TYPE_CHECKING:
    from chunkring.moe.layer import MoELayer
    from chunkring.moe.weights import Fp8Weight
    from chunkring.runtime import Runtime

__all__ = ["DEFAULT_TOLERANCE", "StreamingCalibration", "calibrate", "capture_graph", "replay_median_ms"]

#: How much slower than batch-ready streamed may be, at every calibrated count, for "auto" to stream.
DEFAULT_TOLERANCE = 0.03


@dataclass(frozen=True)
class StreamingCalibration:
    """What :func:`calibrate` measured: per token count, the slowest rank's (batch-ready ms, streamed
    ms), and the tolerance streamed had to meet everywhere for ``"auto"`` to stream."""

    figures: dict[int, tuple[float, ...]]  # token count -> (batch-ready ms, streamed ms)
    tolerance: float

    @property
    def streams(self) -> bool:
        """Whether ``streaming="auto"`` calls stream."""
        return all(streamed <= (1 + self.tolerance) * batch for batch, streamed in self.figures.values())

    def describe(self) -> str:
        ratios = ", ".join(f"{n} tokens {s / b:.3f}" for n, (b, s) in sorted(self.figures.items()))
        verdict = "stream" if self.streams else "run batch-ready"
        return f'streaming="auto" calls {verdict}: streamed / batch-ready {ratios} (tolerance {self.tolerance:.0%})'


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


def replay_median_ms(call: Callable[[], object], load: Callable[[int], object] | None = None, *, iterations: int,
                     warmup: int, barrier: Callable[[], object] | None = None) -> float:
    """Median time of ``call`` captured once in a CUDA graph (:func:`capture_graph`) and replayed
    ``warmup + iterations`` times (the first ``warmup`` not counted), with CUDA events. ``load(i)``, if
    given, refreshes the graph's inputs before replay ``i``; ``barrier()``, if given, runs before each
    replay so the ranks of a collective call replay together."""
    graph = capture_graph(call, load)
    times = []
    for i in range(warmup + iterations):
        if load is not None:
            load(i)
        torch.cuda.synchronize()
        if barrier is not None:
            barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def calibrate(layer: MoELayer, router_weight: torch.Tensor, w13: torch.Tensor | Fp8Weight,
              w2: torch.Tensor | Fp8Weight, token_counts: Iterable[int], *, iterations: int = 10, warmup: int = 2,
              tolerance: float = DEFAULT_TOLERANCE, seed: int = 0) -> StreamingCalibration:
    """Time ``layer.forward`` batch-ready and streamed at each of ``token_counts`` (random hidden states,
    this rank's weights) and agree across ranks on the slowest rank's figures. A collective: every rank
    passes the same counts and settings."""
    cfg = layer.config
    if not cfg.streaming:
        raise ChunkringUsageError("needs a streaming ring (front_num_slots, front_tokens_per_slot)", field="config")
    counts = tuple(token_counts)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cfg.max_tokens_per_rank
                         for n in counts):
        raise ChunkringUsageError(f"need token counts in [1, {cfg.max_tokens_per_rank}], got {token_counts!r}",
                                  field="token_counts")
    for name, value, low in (("iterations", iterations, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ChunkringUsageError(f"must be an int >= {low}, got {value!r}", field=name)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ChunkringUsageError(f"must be in [0, 1), got {tolerance!r}", field="tolerance")
    runtime = layer.runtime
    device = runtime.torch_device
    gen = torch.Generator(device).manual_seed(seed * 7919 + runtime.rank)
    mine = {}
    for n in counts:
        hidden = torch.randn(n, cfg.hidden, generator=gen, device=device).to(torch.bfloat16)
        mine[n] = tuple(
            replay_median_ms(partial(layer.forward, hidden, router_weight, w13, w2, streaming=streaming),
                             iterations=iterations, warmup=warmup, barrier=runtime.barrier)
            for streaming in (False, True))
    return StreamingCalibration(_slowest_rank(runtime, mine), float(tolerance))


def _slowest_rank(runtime: Runtime, mine: dict[int, tuple[float, ...]]) -> dict[int, tuple[float, ...]]:
    """Per token count, the (batch, streamed) pair of the rank where streaming fared worst: identical on
    every rank, so every rank takes the same mode. A collective (``runtime.allgather_object``)."""
    everyone = runtime.allgather_object(mine)
    return {n: max((figures[n] for figures in everyone), key=lambda pair: pair[1] / pair[0]) for n in mine}
