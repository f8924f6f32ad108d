"""Layers built with deliberately broken kernels, for the tests that show each protocol rule is needed.

A variant is a ``CHUNKRING_MUTANT`` value of ``device/include/chunkring/protocol/mutants.cuh``
(:data:`chunkring.testing.stress.MUTANTS` and the MoE layer's own: ``NO_HELD_ACK``, ``NO_PUSH_RELEASE``,
``SEAL_ON_RESERVE``, ``NO_INPUT_CHECKS``). The public constructor never takes one: a test asks here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chunkring.errors import ChunkringUsageError
from chunkring.moe.layer import MoELayer
from chunkring.moe.resources import LayerKernels

if TYPE_CHECKING:
    from chunkring.moe.config import MoEConfig
    from chunkring.runtime import Runtime

__all__ = ["layer_kernels", "mutant_layer"]


def layer_kernels(runtime: Runtime, variant: int) -> LayerKernels:
    """The layer's kernel libraries compiled with ``CHUNKRING_MUTANT=variant`` (0: the real protocol)."""
    if isinstance(variant, bool) or not isinstance(variant, int) or variant < 0:
        raise ChunkringUsageError(f"must be a non-negative int, got {variant!r}", field="variant")
    return LayerKernels.build(runtime, defines={"CHUNKRING_MUTANT": variant} if variant else None)


def mutant_layer(runtime: Runtime, config: MoEConfig, variant: int, **options: Any) -> MoELayer:
    """A :class:`MoELayer` whose kernels are ``variant`` (``options`` as the constructor takes them)."""
    return MoELayer(runtime, config, kernels=layer_kernels(runtime, variant), **options)
