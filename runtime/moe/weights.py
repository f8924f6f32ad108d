"""Expert and router weights of a MoE layer: random draws for tests and benchmarks."""

from __future__ import annotations

import torch

from chunkring.moe.config import MoEConfig

__all__ = ["init_weights"]


def init_weights(config: MoEConfig, generator: torch.Generator | None = None):
    """Every expert's weights and the router, bfloat16 on the CPU, drawn from ``generator`` as scaled
    normal samples: router [E, H], w13 [E, 2I, H], w2 [E, H, I]. Ranks that seed alike draw alike, so
    each can keep its own experts and still compute a reference over all of them."""
    E, H, inter = config.num_experts, config.hidden, config.intermediate

    def draw(*shape, fan_in):
        return (torch.randn(*shape, generator=generator) / fan_in**0.5).to(torch.bfloat16)

    return draw(E, H, fan_in=H), draw(E, 2 * inter, H, fan_in=H), draw(E, H, inter, fan_in=inter)
