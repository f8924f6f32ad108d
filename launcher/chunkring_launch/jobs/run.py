"""The main job: one MoE layer, batch-ready and streamed on the same inputs, each checked against the fp32
reference of the same math, then timed the two ways a caller issues it.

Every rank routes its own ``tokens_per_rank`` tokens (seeded per rank) through the layer's producers
(router GEMM -> TopK -> FP8 quantisation -> publish: ``chunkring.MoEModule``). Fails when either mode's relative
error against the reference exceeds ``tolerance``. Times each mode as CUDA-graph replays (``<mode>_graph_ms``: what a
captured model pays; chunkring.moe.calibration.replay_medians_ms, one replay per sample, the modes interleaved) and
as eager calls (``<mode>_eager_ms``: events around one call, the modes interleaved; issued as the layer's default
issues them, every kernel launched), each the median of ``iterations`` samples after ``warmup``, ranks met before
each sample; ``streamed_over_batch`` compares the graph replays, ``streamed_over_batch_eager`` the eager calls. Also
the symmetric memory of the full input region against the streaming ring. The preset is DeepGEMM's per-rank shape
(configs/run.toml); benchmarks/bench_eager.py --call forward times the same calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from chunkring.errors import UsageProblems

from ..config import check_range
from ..progress import progress
from .moe_workload import (
    LayerFields,
    check_output,
    open_layer,
    reference_output,
    route_batch,
    seeded_hidden,
    seeded_weights,
    transport_figures,
)

if TYPE_CHECKING:
    from chunkring import Runtime

#: The layer's two call modes, as the figures name them.
MODES = ("batch", "streamed")


@dataclass(frozen=True)
class CONFIG(LayerFields):
    tokens_per_rank: int = 512
    iterations: int = 20
    warmup: int = 3

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        if not problems.reported("max_tokens_per_rank"):
            check_range(problems, self, "tokens_per_rank", 0, self.max_tokens_per_rank,
                        f"at most max_tokens_per_rank={self.max_tokens_per_rank}")
        for name in ("iterations", "warmup"):
            check_range(problems, self, name, 1, 100_000)


def run(runtime: Runtime, config: CONFIG) -> dict[str, float]:
    """Check and time the layer on this rank; returns this rank's figures."""
    import torch

    from chunkring import MoEModule
    from chunkring.moe.calibration import replay_medians_ms

    cfg = config.layer_config()
    device = runtime.torch_device
    with open_layer(runtime, config, cfg) as layer:
        module = MoEModule(layer, generator=torch.Generator().manual_seed(config.seed))
        weights = seeded_weights(layer, config.seed)
        hidden = seeded_hidden(config.tokens_per_rank, cfg.hidden, config.seed * 1000 + 1 + runtime.rank, device)
        ref = reference_output(route_batch(hidden, module.router_weight, cfg.topk, config.payload), weights)
        figures: dict[str, float] = {**transport_figures(layer)}  # which data path these times are of
        calls = {mode: partial(module, hidden, streaming=mode == "streamed") for mode in MODES}
        for mode, call in calls.items():
            out = call()
            torch.cuda.synchronize()
            layer.check()
            figures[f"{mode}_rel_error"], _ = check_output(out, ref, tolerance=config.tolerance,
                                                           what=f"rank {runtime.rank}: {mode}")
        for mode, ms in _eager_ms(calls, runtime, config).items():
            figures[f"{mode}_eager_ms"] = ms
        graph = replay_medians_ms(calls, iterations=config.iterations, warmup=config.warmup, barrier=runtime.barrier)
        for mode, ms in graph.items():
            figures[f"{mode}_graph_ms"] = ms
        layer.check()
        figures["streamed_over_batch"] = figures["streamed_graph_ms"] / figures["batch_graph_ms"]
        figures["streamed_over_batch_eager"] = figures["streamed_eager_ms"] / figures["batch_eager_ms"]
        memory = layer.memory()
        figures["full_input_region_MiB"] = memory["full_input_region_bytes"] / 2**20
        figures["streaming_ring_MiB"] = memory["streaming_ring_bytes"] / 2**20
        return figures


def _eager_ms(calls: Mapping[str, Callable[[], object]], runtime: Runtime, config: CONFIG) -> dict[str, float]:
    """Per mode, the median over ``iterations`` of one eager call's time (CUDA events around it), the modes
    interleaved in rounds whose order rotates, the device idle and the ranks met before each sample."""
    import statistics

    import torch

    for _ in range(config.warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {mode: [] for mode in calls}
    bar = progress("timing eager calls", runtime.rank, total=config.iterations)
    modes = list(calls)
    for round_ in range(config.iterations):
        for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
            torch.cuda.synchronize()
            runtime.barrier()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[mode]()
            stop.record()
            stop.synchronize()
            times[mode].append(start.elapsed_time(stop))
        bar.update(round_ + 1)
    bar.close(config.iterations)
    return {mode: statistics.median(samples) for mode, samples in times.items()}
