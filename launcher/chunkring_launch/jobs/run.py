"""One MoE workload: the layer batch-ready and streamed on the same inputs, each checked against the
fp32 reference of the same math, then timed.

Every rank routes its own ``tokens_per_rank`` tokens (seeded per rank) through the layer's producers
(router GEMM -> TopK -> FP8 quantisation -> publish). Fails when either mode's relative error against
the reference exceeds ``tolerance``; reports both errors, the median time per call of each mode, and
the symmetric memory of the full input region against the streaming ring.
"""

from __future__ import annotations

from collections.abc import Callable
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

    cfg = config.layer_config()
    device = runtime.torch_device
    with open_layer(runtime, config, cfg) as layer:
        module = MoEModule(layer, generator=torch.Generator().manual_seed(config.seed))
        weights = seeded_weights(layer, config.seed)
        hidden = seeded_hidden(config.tokens_per_rank, cfg.hidden, config.seed * 1000 + 1 + runtime.rank, device)
        ref = reference_output(route_batch(hidden, module.router_weight, cfg.topk, config.payload), weights)
        figures: dict[str, float] = {**transport_figures(layer)}  # which data path these times are of
        for mode, streaming in (("batch", False), ("streamed", True)):
            out = module(hidden, streaming=streaming)
            torch.cuda.synchronize()
            layer.check()
            figures[f"{mode}_rel_error"], _ = check_output(out, ref, tolerance=config.tolerance,
                                                           what=f"rank {runtime.rank}: {mode}")
            figures[f"{mode}_ms"] = _median_ms(partial(module, hidden, streaming=streaming), runtime, config,
                                               label=f"timing {mode}")
        layer.check()
        figures["streamed_over_batch"] = figures["streamed_ms"] / figures["batch_ms"]
        memory = layer.memory()
        figures["full_input_region_MiB"] = memory["full_input_region_bytes"] / 2**20
        figures["streaming_ring_MiB"] = memory["streaming_ring_bytes"] / 2**20
        return figures


def _median_ms(call: Callable[[], object], runtime: Runtime, config: CONFIG, *, label: str) -> float:
    """Median over ``iterations`` calls of one call's time, ranks started together for each."""
    import statistics

    import torch

    for _ in range(config.warmup):
        call()
    times = []
    bar = progress(label, runtime.rank, total=config.iterations)
    for _ in range(config.iterations):
        torch.cuda.synchronize()
        runtime.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        bar.update(len(times), f"median {statistics.median(times):.3f} ms")
    bar.close(len(times), f"median {statistics.median(times):.3f} ms")
    return statistics.median(times)
