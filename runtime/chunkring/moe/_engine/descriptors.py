"""The MoE layer's device descriptors: the stage and the block pool, each handed to its kernels as one
pointer to 64-bit words instead of a dozen loose arguments.

``device/include/chunkring/layout/moe_desc.cuh`` declares ``StageDesc`` and ``PoolDesc`` with the fields of
:data:`STAGE_FIELDS` and :data:`POOL_FIELDS`, in this order (a unit test compares them). Each begins with
``layout_version`` and ``desc_bytes``, which every kernel checks before it reads anything else. A
descriptor is built once, when its buffers are allocated: their addresses never change, so a CUDA graph
captured with it stays valid.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["MOE_LAYOUT_VERSION", "POOL_FIELDS", "STAGE_FIELDS", "descriptor_tensor", "descriptor_words"]

#: Bumped whenever a field of either descriptor changes; kernels refuse other versions.
MOE_LAYOUT_VERSION = 1

WORD = 8

#: ``StageDesc``'s fields: shapes, then the stage's tensors' addresses (chunkring.moe._engine.stage.Stage).
STAGE_FIELDS = (
    "layout_version", "desc_bytes", "sources", "token_capacity", "topk", "row_bytes", "sf_per_row",
    "expert_lo", "expert_hi", "x", "sf", "idx", "w", "held",
)

#: ``PoolDesc``'s fields: the pool's shape, then its tensors' addresses (chunkring.moe._engine.blocks.BlockPool).
POOL_FIELDS = (
    "layout_version", "desc_bytes", "experts", "blocks_per_expert", "blocks", "block_m", "row_bytes",
    "sf_per_row", "words", "pos", "x", "sf", "src", "token", "k", "weight",
)


def descriptor_words(fields: tuple[str, ...], values: Mapping[str, int | torch.Tensor]) -> np.ndarray:
    """The descriptor's words in ``fields`` order: ``layout_version`` and ``desc_bytes`` filled in here, every
    other field from ``values`` (a tensor gives its address). A missing or unknown field is a bug of the
    caller, not an input error: it raises ``KeyError`` naming it."""
    given = {"layout_version": MOE_LAYOUT_VERSION, "desc_bytes": WORD * len(fields)}
    for name, value in values.items():
        given[name] = value.data_ptr() if isinstance(value, torch.Tensor) else int(value)
    if set(given) != set(fields):
        raise KeyError(f"descriptor fields differ: missing {sorted(set(fields) - set(given))}, "
                       f"unknown {sorted(set(given) - set(fields))}")
    return np.array([given[name] for name in fields], dtype=np.uint64)


def descriptor_tensor(fields: tuple[str, ...], values: Mapping[str, int | torch.Tensor],
                      device: torch.device | str) -> torch.Tensor:
    """:func:`descriptor_words` as an int64 tensor on ``device`` (the kernels' ``const StageDesc*`` or
    ``const PoolDesc*``; torch has no uint64 arithmetic, the bits are the same)."""
    return torch.from_numpy(descriptor_words(fields, values).view(np.int64)).to(device)
