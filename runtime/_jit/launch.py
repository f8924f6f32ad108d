"""Typed launches: each kernel declares its parameters once, and every call is checked against them.

A wrong dtype, a CPU tensor, a non-contiguous view or an out-of-range integer is a
``ChunkringUsageError`` before anything is enqueued. Scalars are converted to the exact NumPy type the
kernel expects (cuda.core would pass a bare Python int as a pointer).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

__all__ = ["KernelLibrary", "Param", "library_for"]

#: Loaded libraries per Runtime, by source name (freed with the Runtime).
_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_SCALARS = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: ``kind`` is ``"ptr"`` (a CUDA tensor of ``dtype``; ``None`` passes a null
    pointer if ``nullable``) or a scalar kind."""

    name: str
    kind: str
    dtype: object = None  # torch.dtype, for pointers
    nullable: bool = False

    def __post_init__(self):
        if self.kind != "ptr" and self.kind not in _SCALARS:
            raise ChunkringUsageError(f"unknown parameter kind {self.kind!r}", field=self.name)
        if self.kind == "ptr" and self.dtype is None:
            raise ChunkringUsageError("a pointer parameter needs its dtype", field=self.name)
        if self.nullable and self.kind != "ptr":
            raise ChunkringUsageError("only a pointer parameter can be nullable", field=self.name)

    def convert(self, value, device):
        import torch

        if self.kind == "ptr":
            if value is None and self.nullable:
                return 0  # cuda.core passes a Python int as intptr_t: the null pointer
            if not isinstance(value, torch.Tensor):
                raise ChunkringUsageError(f"expected a torch.Tensor, got {type(value).__name__}", field=self.name)
            if value.dtype != self.dtype:
                raise ChunkringUsageError(f"expected dtype {self.dtype}, got {value.dtype}", field=self.name)
            if not value.is_contiguous():
                raise ChunkringUsageError("tensor must be contiguous", field=self.name)
            if value.device != device:
                raise ChunkringUsageError(f"tensor is on {value.device}, kernel runs on {device}", field=self.name)
            return value.data_ptr()
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ChunkringUsageError(f"expected an integer, got {type(value).__name__}", field=self.name)
        info = np.iinfo(_SCALARS[self.kind])
        if not info.min <= int(value) <= info.max:
            raise ChunkringUsageError(f"{value} does not fit {self.kind}", field=self.name)
        return _SCALARS[self.kind](value)


class KernelLibrary:
    """A compiled kernel library registered with NVSHMEM, with checked launches of its kernels."""

    def __init__(self, runtime, build_result, signatures: dict[str, tuple[Param, ...]]):
        self.runtime = runtime
        self.build = build_result
        self._signatures = dict(signatures)
        runtime.load(build_result.object_code)
        try:
            self._kernels = {name: build_result.object_code.get_kernel(name) for name in self._signatures}
        except Exception as exc:
            raise ChunkringRuntimeError(f"kernel missing from {build_result.name}: {exc}") from exc
        for name, kernel in self._kernels.items():
            _load_now(name, kernel)

    def __repr__(self) -> str:
        return f"KernelLibrary({self.build.name!r}, kernels={sorted(self._signatures)})"

    def resident_blocks_per_sm(self, name: str, block: int, shared_bytes: int = 0) -> int:
        """How many blocks of kernel ``name`` one SM holds at once (the occupancy calculator)."""
        if name not in self._kernels:
            raise ChunkringUsageError(f"no kernel {name!r} in {self.build.name}", field="name")
        return int(self._kernels[name].occupancy.max_active_blocks_per_multiprocessor(block, shared_bytes))

    def launch(self, name: str, *args, grid=1, block=128, stream=None, shared_bytes: int = 0) -> None:
        """Enqueue kernel ``name`` on ``stream`` (a torch stream; the current one by default)."""
        import torch
        from cuda.core import LaunchConfig, launch

        if name not in self._signatures:
            raise ChunkringUsageError(f"no kernel {name!r} in {self.build.name}", field="name")
        params = self._signatures[name]
        if len(args) != len(params):
            raise ChunkringUsageError(f"{name} takes {len(params)} arguments, got {len(args)}", field="args")
        device = self.runtime.torch_device
        values = [param.convert(arg, device) for param, arg in zip(params, args)]
        torch_stream = stream if stream is not None else torch.cuda.current_stream(device)
        if torch_stream.device != device:
            raise ChunkringUsageError(f"stream is on {torch_stream.device}, kernel runs on {device}", field="stream")
        stream_obj = self.runtime.device.create_stream(torch_stream)
        try:
            launch(stream_obj, LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes), self._kernels[name], *values)
        except Exception as exc:
            raise ChunkringRuntimeError(f"launch of {name} failed: {exc}") from exc


def _load_now(name: str, kernel) -> None:
    """Load ``kernel`` into the current context now, not at its first launch.

    Under CUDA's lazy loading, a kernel's first launch loads its code, and that load can wait for
    kernels already running. Our kernels spin on each other: a consumer launched for the first time
    while a producer spins for its acknowledgements would wait for that producer forever (seen on the
    H200 until the watchdog fired). Loading every kernel up front removes the hazard.
    """
    from cuda.bindings import driver

    err, function = driver.cuKernelGetFunction(driver.CUkernel(int(kernel.handle)))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ChunkringRuntimeError(f"cuKernelGetFunction({name}) failed: {err}")
    err, _ = driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ChunkringRuntimeError(f"loading {name} failed: {err}")


def library_for(runtime, source: str, signatures: dict[str, tuple[Param, ...]]) -> KernelLibrary:
    """The library built from ``device/kernels/<source>.cu``, loaded once per Runtime."""
    from chunkring._jit.compiler import build

    loaded = _LOADED.setdefault(runtime, {})
    if source not in loaded:
        loaded[source] = KernelLibrary(runtime, build(source), signatures)
    return loaded[source]
