"""Run-time kernel build and typed launches: NVRTC compilation with an on-disk cache
(:mod:`chunkring.jit.compiler`), each kernel's parameters read from its ``extern "C"`` signature
(:mod:`chunkring.jit.signatures`, with :class:`ArgStruct`, the host mirror of a kernel argument struct), kernel
libraries whose launches are checked against them (:mod:`chunkring.jit.launch`), the tensor maps of the copy
engine's tiled copies (:mod:`chunkring.jit.tensor_map`) and what a captured CUDA graph's nodes hold
(:mod:`chunkring.jit.graph_nodes`). The CUDA sources live in ``device/``.
"""

from chunkring.jit.compiler import BuildResult, arch_of, build, default_arch, kernel_sources, nvshmem_version
from chunkring.jit.launch import KernelArgs, KernelLibrary, Param, library_for
from chunkring.jit.signatures import ArgStruct, parse_kernels
from chunkring.jit.tensor_map import TensorMap, encode_tiled

__all__ = ["ArgStruct", "BuildResult", "KernelArgs", "KernelLibrary", "Param", "TensorMap", "arch_of", "build",
           "default_arch", "encode_tiled", "kernel_sources", "library_for", "nvshmem_version", "parse_kernels"]
