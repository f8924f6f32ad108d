"""The kernel libraries a MoE layer launches (:class:`LayerKernels`), built for a runtime's GPU. Public: a layer takes
them (``MoELayer(kernels=...)``), which is how :mod:`chunkring.testing.variants` hands it deliberately broken ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkring.jit import library_for

if TYPE_CHECKING:
    from chunkring.jit import KernelLibrary
    from chunkring.runtime import Runtime

__all__ = ["LayerKernels"]


@dataclass(frozen=True)
class LayerKernels:
    """The layer's kernel libraries: ``stream`` (device/kernels/moe_stream.cu: pull, held acks, drain,
    timeline marks), ``produce`` (moe_produce.cu: the fused producer) and ``experts`` (moe_experts.cu:
    plan, SwiGLU, combine push, waves)."""

    stream: KernelLibrary
    produce: KernelLibrary
    experts: KernelLibrary

    @classmethod
    def build(cls, runtime: Runtime, *, defines: dict[str, int | str] | None = None) -> LayerKernels:
        """The libraries for ``runtime``'s GPU, compiled with ``defines`` (None: the real protocol; the
        testing package passes a ``CHUNKRING_MUTANT`` to build a deliberately broken variant)."""
        return cls(*(library_for(runtime, source, defines=defines)
                     for source in ("moe_stream", "moe_produce", "moe_experts")))
