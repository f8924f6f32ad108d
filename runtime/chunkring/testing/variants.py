"""Layers built with deliberately broken kernels, for the tests that show each protocol rule is needed.

A variant is a ``CHUNKRING_MUTANT`` value of ``device/include/chunkring/protocol/mutants.cuh``
(:data:`chunkring.testing.stress.MUTANTS` and the MoE layer's own: ``NO_HELD_ACK``, ``NO_PUSH_RELEASE``,
``SEAL_ON_RESERVE``, ``NO_INPUT_CHECKS``, ``ARRIVE_BEFORE_ROWS``). The public constructor never takes one: a
test asks here, for a whole layer or for the fused producer's library alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chunkring.errors import ChunkringUsageError
from chunkring.jit import library_for
from chunkring.moe.kernels import LayerKernels
from chunkring.moe.layer import MoELayer

if TYPE_CHECKING:
    from chunkring.jit import KernelLibrary
    from chunkring.moe.config import MoEConfig
    from chunkring.runtime import Runtime

__all__ = ["layer_kernels", "mutant_layer", "produce_kernels"]


def layer_kernels(runtime: Runtime, variant: int) -> LayerKernels:
    """The layer's kernel libraries compiled with ``CHUNKRING_MUTANT=variant`` (0: the real protocol)."""
    _check_variant(variant)
    return LayerKernels.build(runtime, defines={"CHUNKRING_MUTANT": variant} if variant else None)


def produce_kernels(runtime: Runtime, variant: int) -> KernelLibrary:
    """The fused producer's library (``moe_produce``: the router GEMM and ``moe_produce_chunk``) compiled with
    ``CHUNKRING_MUTANT=variant`` (0: the real protocol), without building the layer's other libraries."""
    _check_variant(variant)
    return library_for(runtime, "moe_produce", defines={"CHUNKRING_MUTANT": variant} if variant else None)


def mutant_layer(runtime: Runtime, config: MoEConfig, variant: int, **options: Any) -> MoELayer:
    """A :class:`MoELayer` whose kernels are ``variant`` (``options`` as the constructor takes them)."""
    return MoELayer(runtime, config, kernels=layer_kernels(runtime, variant), **options)


def _check_variant(variant: object) -> None:
    if isinstance(variant, bool) or not isinstance(variant, int) or variant < 0:
        raise ChunkringUsageError(f"must be a non-negative int, got {variant!r}", field="variant")
