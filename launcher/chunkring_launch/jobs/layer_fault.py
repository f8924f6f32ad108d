"""A MoE layer job whose rank ``rank`` SIGKILLs itself at one ``phase`` of the layer's life: its first call, a
streamed call, a CUDA-graph replay, the reset, the destroy (every other rank goes on into that phase and waits
for it there). The fault matrix's kill cells (tests/faults/test_fault_kill.py) drive it through the launcher,
which must end the job with status 5 naming the rank, leaving no process and no MPS daemon behind. Registered
only when ``CHUNKRING_TEST_JOBS=1``; it has no preset, so give it one with ``--config FILE.toml``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkring.errors import UsageProblems

from ..config import check_range
from .moe_workload import LayerFields, open_layer, seeded_hidden, seeded_weights

if TYPE_CHECKING:
    from chunkring import Runtime

PHASES = ("first_call", "streamed", "graph_replay", "reset", "destroy")


@dataclass(frozen=True)
class CONFIG(LayerFields):
    phase: str = "streamed"
    rank: int = 1            # the rank that is killed
    tokens_per_rank: int = 37

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        if self.phase not in PHASES:
            problems.add(f"must be one of {list(PHASES)}, got {self.phase!r}", field="phase")
        check_range(problems, self, "rank", 0, 1 << 16)
        check_range(problems, self, "tokens_per_rank", 1, self.max_tokens_per_rank)


def run(runtime: Runtime, config: CONFIG) -> dict[str, int]:
    import torch

    def reach(phase: str) -> None:
        if phase == config.phase and runtime.rank == config.rank:
            os.kill(os.getpid(), signal.SIGKILL)

    with open_layer(runtime, config) as layer:
        weights = seeded_weights(layer, config.seed)
        hidden = seeded_hidden(config.tokens_per_rank, layer.config.hidden, config.seed + runtime.rank,
                               runtime.torch_device)

        def call() -> torch.Tensor:
            return layer.forward(hidden, weights.router, weights.w13, weights.w2, streaming=True)

        def finish() -> None:
            torch.cuda.synchronize()
            layer.check()

        reach("first_call")
        call()
        finish()
        reach("streamed")
        call()
        finish()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        reach("graph_replay")
        graph.replay()
        finish()
        reach("reset")
        layer.reset()
        reach("destroy")  # open_layer's exit destroys the layer: every other rank waits for this one there
    return {"phases": len(PHASES)}
