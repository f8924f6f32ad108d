"""Run-time kernel build and typed launches: NVRTC compilation with an on-disk cache
(:mod:`chunkring._jit.compiler`) and kernel libraries whose launches are checked against each
kernel's declared parameters (:mod:`chunkring._jit.launch`). The CUDA sources live in ``device/``.
"""

from chunkring._jit.compiler import BuildResult, build, kernel_sources, nvshmem_version
from chunkring._jit.launch import KernelLibrary, Param, library_for

__all__ = ["BuildResult", "KernelLibrary", "Param", "build", "kernel_sources", "library_for", "nvshmem_version"]
