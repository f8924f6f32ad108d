"""The size of the consumer's expert plan: how many padded rows one call can bring to one rank.

The plan itself is built on the device (``moe_plan_count`` / ``moe_plan_scatter`` in
device/kernels/moe_experts.cu, driven by :mod:`chunkring.moe.experts`): every pulled (source, token, k)
choice routed to one of this rank's experts takes a row of its expert's group, and each group is padded
to a multiple of ``block_m`` rows. :func:`chunkring.testing.plan.plan_batch` is its host reference.
"""

from __future__ import annotations

from chunkring.errors import ChunkringUsageError

__all__ = ["padded_rows_bound"]


def padded_rows_bound(rows_per_source: int, topk: int, world_size: int, experts_per_rank: int, block_m: int) -> int:
    """The most padded rows one call's plan can produce at one destination (the size of the consumer's
    fixed device buffers), when each source brings at most ``rows_per_source`` rows (the layer passes
    ``max_tokens_per_rank``).

    Derivation: at most ``R = W * rows_per_source * K`` real rows reach one destination (K, not
    min(K, E_local): nothing forbids a row from naming one expert twice, and each (token, k) is its own
    row). A group of ``c >= 1`` rows pads to ``block_m * ceil(c / block_m)`` and an empty group to 0. With
    ``g`` non-empty groups the block count is ``sum(1 + (c_e - 1) // block_m) <= g + (R - g) // block_m``,
    which does not decrease with ``g``; so take ``g = min(E_local, R)``. It is reached (``g - 1`` groups of
    one row, one group of the rest), so the bound is tight:  ``block_m * (g + (R - g) // block_m)``.
    """
    for name, value in (("rows_per_source", rows_per_source), ("topk", topk), ("world_size", world_size),
                        ("experts_per_rank", experts_per_rank), ("block_m", block_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ChunkringUsageError(f"must be a positive int, got {value!r}", field=name)
    real = world_size * rows_per_source * topk
    groups = min(experts_per_rank, real)
    return block_m * (groups + (real - groups) // block_m)
