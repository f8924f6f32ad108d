"""Typed launches: every argument is passed by the name of its kernel parameter and checked against it;
the kernel's ``extern "C"`` signature in the .cu declares the parameters once
(:mod:`chunkring.jit.signatures` reads them at build time).

A missing or unknown name, a wrong dtype, a CPU tensor, a non-contiguous view or an out-of-range integer is a
``ChunkringUsageError`` before anything is enqueued. Scalars are converted to the exact NumPy type the
kernel expects (cuda.core would pass a bare Python int as a pointer). A kernel that takes a struct by value - a
tensor map (``const __grid_constant__ TensorMap``, 128 bytes) or an argument struct (``const __grid_constant__
FooArgs``, :class:`chunkring.jit.signatures.ArgStruct`), which cuda.core's launch cannot pass - is launched through
the driver's ``cuLaunchKernelEx`` with a parameter buffer built here, every other one through cuda.core.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.jit.signatures import STRUCT, TENSOR_MAP, Param, check_argument_names

if TYPE_CHECKING:
    import numpy as np
    import torch
    from cuda.core import Kernel, ObjectCode

    from chunkring.jit.compiler import BuildResult
    from chunkring.runtime import Runtime

# Param lives with the signatures that make it.
__all__ = ["LAUNCH_KEYWORDS", "KernelArgs", "KernelLibrary", "Param", "allow_dynamic_shared", "check_argument_names",
           "launch_by_driver", "library_for"]

#: Dynamic shared memory a block may take without its kernel opting in to more (CUDA's default limit).
_DEFAULT_SHARED_BYTES = 48 * 1024

#: Loaded libraries per Runtime, by (source name, defines) (freed with the Runtime).
_LOADED: weakref.WeakKeyDictionary[Runtime, dict[tuple, KernelLibrary]] = weakref.WeakKeyDictionary()


class KernelLibrary:
    """A compiled kernel library (registered with NVSHMEM if it uses it), with checked launches of each of its kernels
    (the parameters ``build_result.signatures`` read from its source)."""

    def __init__(self, runtime: Runtime, build_result: BuildResult) -> None:
        self.runtime = runtime
        self.build = build_result
        self._signatures = dict(build_result.signatures)
        self._names = {name: frozenset(param.name for param in params) for name, params in self._signatures.items()}
        for name, params in self._signatures.items():
            taken = LAUNCH_KEYWORDS & {param.name for param in params}
            if taken:
                raise ChunkringRuntimeError(f"{build_result.name}: kernel {name} names a parameter "
                                            f"{sorted(taken)}, which launch() keeps for itself")
        if uses_nvshmem(build_result.object_code):
            runtime.load(build_result.object_code)
        try:
            self._kernels = {name: build_result.object_code.get_kernel(name) for name in self._signatures}
        except Exception as exc:
            raise ChunkringRuntimeError(f"kernel missing from {build_result.name}: {exc}") from exc
        for name, kernel in self._kernels.items():
            _load_now(name, kernel)
        self._shared_allowed: dict[str, int] = {}  # kernels opted in to more dynamic shared memory, and how much
        self._by_driver = {name for name, params in self._signatures.items()
                           if any(param.kind in (TENSOR_MAP, STRUCT) for param in params)}

    def __repr__(self) -> str:
        return f"KernelLibrary({self.build.name!r}, kernels={sorted(self._signatures)})"

    def resident_blocks_per_sm(self, name: str, block: int, shared_bytes: int = 0) -> int:
        """How many blocks of kernel ``name`` one SM holds at once (the occupancy calculator)."""
        if name not in self._kernels:
            raise ChunkringUsageError(f"no kernel {name!r} in {self.build.name}", field="name")
        return int(self._kernels[name].occupancy.max_active_blocks_per_multiprocessor(block, shared_bytes))

    def launch(self, name: str, /, *, grid: int | tuple[int, ...] = 1, block: int | tuple[int, ...] = 128,
               stream: torch.cuda.Stream | None = None, shared_bytes: int = 0, pdl: bool = False,
               **args: object) -> None:
        """Enqueue kernel ``name`` on ``stream`` (a torch stream; the current one by default), every parameter
        given by its name in the kernel's signature: ``launch("moe_drain", desc=ring.desc, block=32)``.
        ``pdl``: a programmatic dependent launch - the kernel may start before the stream's previous kernel has
        finished, so it must wait for it (device/include/chunkring/ptx/dependent_launch.cuh) before touching
        memory."""
        import torch
        from cuda.core import LaunchConfig, launch

        if name not in self._signatures:
            raise ChunkringUsageError(f"no kernel {name!r} in {self.build.name}", field="name")
        params = self._signatures[name]
        if args.keys() != self._names[name]:  # one set comparison per launch; the error lists every difference
            check_argument_names(name, params, args)
        device = self.runtime.torch_device
        values = [param.convert(args[param.name], device) for param in params]
        torch_stream = stream if stream is not None else torch.cuda.current_stream(device)
        if torch_stream.device != device:
            raise ChunkringUsageError(f"stream is on {torch_stream.device}, kernel runs on {device}", field="stream")
        if shared_bytes > self._shared_allowed.get(name, _DEFAULT_SHARED_BYTES):
            allow_dynamic_shared(self._kernels[name], shared_bytes, self.runtime.ordinal, name)
            self._shared_allowed[name] = shared_bytes
        if name in self._by_driver:
            launch_by_driver(self._kernels[name], name, params, values, grid=grid, block=block,
                             shared_bytes=shared_bytes, stream_handle=int(torch_stream.cuda_stream), pdl=pdl)
            return
        stream_obj = self.runtime.device.create_stream(torch_stream)
        try:
            config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes,
                                  programmatic_stream_serialization=pdl)
            launch(stream_obj, config, self._kernels[name], *values)
        except Exception as exc:
            raise ChunkringRuntimeError(f"launch of {name} failed: {exc}") from exc

#: A scalar parameter's kind -> its C type, for the driver's parameter buffer.
_SCALAR_CTYPES = {"i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64}
_BY_VALUE_ALIGN = 64  # a tensor map's (CUtensorMap); an argument struct's words need 8


#: Launch configurations made, by (grid, block, shared bytes, stream, pdl): the driver reads one at each launch and
#: keeps nothing of it, so a layer's launches reuse a few instead of building each (a few microseconds apiece).
_CONFIGS: dict[tuple[object, ...], Any] = {}
_MAX_CONFIGS = 1024


def _launch_config(grid: int | tuple[int, ...], block: int | tuple[int, ...], shared_bytes: int, stream_handle: int,
                   pdl: bool) -> Any:
    """The driver's CUlaunchConfig for these values (made once; ``pdl``: the programmatic-serialization attribute)."""
    from cuda.bindings import driver

    key = (_hashable(grid, "grid"), _hashable(block, "block"), shared_bytes, stream_handle, pdl)
    config = _CONFIGS.get(key)
    if config is not None:
        return config
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = _dims(grid, "grid")
    config.blockDimX, config.blockDimY, config.blockDimZ = _dims(block, "block")
    config.sharedMemBytes = shared_bytes
    config.hStream = driver.CUstream(stream_handle)
    if pdl:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attribute], 1
    if len(_CONFIGS) >= _MAX_CONFIGS:  # streams and grids come and go: start afresh rather than grow
        _CONFIGS.clear()
    _CONFIGS[key] = config
    return config


def _hashable(value: int | tuple[int, ...], what: str) -> object:
    """A grid or block as a key: an int or a tuple as it is, a list as its tuple; anything else :func:`_dims`
    refuses."""
    if isinstance(value, (int, tuple)):
        return value
    return tuple(value) if isinstance(value, list) else _dims(value, what)


def _dims(value: int | tuple[int, ...], what: str) -> list[int]:
    """A grid or block as the driver's three extents (x, y, z), the missing ones 1."""
    dims = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ChunkringUsageError(f"expected 1 to 3 positive ints, got {value!r}", field=what)
    return dims + [1] * (3 - len(dims))


def launch_by_driver(kernel: Kernel, name: str, params: tuple[Param, ...], values: list[int | np.integer | bytes], *,
                     grid: int | tuple[int, ...], block: int | tuple[int, ...], shared_bytes: int,
                     stream_handle: int, pdl: bool = False) -> None:
    """Enqueue ``kernel`` with ``cuLaunchKernelEx``: each of ``values`` (``Param.convert``'s: a pointer as an int, a
    scalar as its NumPy type, a tensor map or an argument struct as its bytes) copied into a buffer of its own, the
    driver given their addresses. The driver copies the parameters at the call, so the buffers need not outlive it.
    ``pdl``: a programmatic dependent launch (the launch attribute cuda.core sets for it)."""
    from cuda.bindings import driver

    storage: list[ctypes._CData] = []
    addresses = (ctypes.c_void_p * len(params))()
    for i, (param, value) in enumerate(zip(params, values, strict=True)):
        if isinstance(value, bytes):  # a struct by value, at a 64-byte boundary as CUtensorMap is aligned
            buffer = (ctypes.c_uint8 * (len(value) + _BY_VALUE_ALIGN))()
            at = -ctypes.addressof(buffer) % _BY_VALUE_ALIGN
            ctypes.memmove(ctypes.addressof(buffer) + at, value, len(value))
            storage.append(buffer)
            addresses[i] = ctypes.addressof(buffer) + at
            continue
        item = ctypes.c_uint64(int(value)) if param.kind == "ptr" else _SCALAR_CTYPES[param.kind](int(value))
        storage.append(item)
        addresses[i] = ctypes.addressof(item)
    # A library's CUkernel passed as a CUfunction: the driver launches it in the stream's context, with the
    # attributes cuKernelSetAttribute gave it (allow_dynamic_shared), as cuda.core's launches do.
    function = driver.CUfunction(int(kernel.handle))
    (err,) = driver.cuLaunchKernelEx(_launch_config(grid, block, shared_bytes, stream_handle, pdl), function,
                                     ctypes.addressof(addresses), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ChunkringRuntimeError(f"launch of {name} failed: {err}")


#: Some of a kernel's arguments by parameter name, for a launch to expand (``**args``); each value is checked
#: against its parameter there.
KernelArgs = dict[str, Any]

#: The launch's own keywords: no kernel parameter may take one of these names.
LAUNCH_KEYWORDS = frozenset({"grid", "block", "stream", "shared_bytes", "pdl"})


def allow_dynamic_shared(kernel: Kernel, nbytes: int, ordinal: int, name: str) -> None:
    """Opt ``kernel`` (``name``, for errors) in to ``nbytes`` of dynamic shared memory per block on GPU ``ordinal``:
    past 48 KiB a launch fails unless the kernel's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES allows it. More
    than the GPU has is a ``ChunkringUsageError`` here, before anything is enqueued."""
    from cuda.bindings import driver

    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = driver.CUkernel(int(kernel.handle))
    (err,) = driver.cuKernelSetAttribute(attribute, nbytes, handle, driver.CUdevice(ordinal))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ChunkringUsageError(f"{name}: {nbytes} bytes of dynamic shared memory a block: {err}",
                                  field="shared_bytes")


#: The device-state symbol NVSHMEM binds in every library that calls its device API.
_NVSHMEM_STATE = b"nvshmemi_device_state_d"


def uses_nvshmem(object_code: ObjectCode) -> bool:
    """Whether a cubin references NVSHMEM's device state: such a library must be registered with NVSHMEM
    before its kernels run; one that does not (pure compute kernels) has nothing to register, and NVSHMEM
    refuses it ("named symbol not found")."""
    return _NVSHMEM_STATE in bytes(object_code.code)


def _load_now(name: str, kernel: Kernel) -> None:
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


def library_for(runtime: Runtime, source: str, *, defines: dict[str, int | str] | None = None) -> KernelLibrary:
    """The library built from ``device/kernels/<source>.cu`` with ``defines`` for the Runtime's GPU,
    loaded once per Runtime and set of defines."""
    from chunkring.jit.compiler import arch_of, build

    key = (source, tuple(sorted((defines or {}).items())))
    loaded = _LOADED.setdefault(runtime, {})
    if key not in loaded:
        loaded[key] = KernelLibrary(runtime, build(source, defines=defines, arch=arch_of(runtime.device)))
    return loaded[key]
