"""chunkring.device: CUDA C++ kernels, their NVRTC build and cache, and typed launch wrappers."""

from .compiler import BuildResult, build, kernel_sources, nvshmem_version
from .launch import KernelLibrary, Param, library_for

__all__ = ["BuildResult", "KernelLibrary", "Param", "build", "kernel_sources", "library_for", "nvshmem_version"]
