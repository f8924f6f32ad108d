"""Compile chunkring's CUDA C++ kernels at run time with NVRTC, cached on disk.

Why NVRTC (route A in docs/BUILD.md): it needs no CUDA toolkit on the serving machine (the compiler
is a pip wheel), compiles NVSHMEM's device API header-only in one step, and runs without a GPU, so CI
compiles exactly what the GPU host will load.

The cache key covers everything that can change the cubin: the kernel source, every chunkring header,
the NVSHMEM version and headers, the NVRTC version, and every compiler option as NVRTC receives it
(the target architecture and the macros among them). The target is the GPU's own architecture (its ``a``
variant for the sources in :data:`ARCH_SPECIFIC_SOURCES`); where no GPU is visible (CI compiles on CPUs) it is
:data:`CPU_FALLBACK_ARCH` unless ``arch=`` names one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from chunkring.env import cache_dir
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.jit.signatures import Param, parse_kernels

if TYPE_CHECKING:
    from cuda.core import Device, ObjectCode, ProgramOptions

__all__ = ["ARCH_SPECIFIC_SOURCES", "CPU_FALLBACK_ARCH", "KERNEL_DIR", "INCLUDE_DIR", "BuildResult", "arch_of", "build",
           "default_arch", "headers_digest", "include_path", "nvrtc_version",
           "cache_key", "kernel_sources", "nvshmem_version", "program_options", "target_arch"]

#: The CUDA sources: the repository's top-level ``device/`` (headers and kernels only), which the package
#: reaches through its ``device`` link and a wheel carries as package data.
DEVICE_DIR = Path(__file__).resolve().parents[1] / "device"
KERNEL_DIR = DEVICE_DIR / "kernels"
INCLUDE_DIR = DEVICE_DIR / "include"
#: The target where no GPU is visible: the GPU host's H200 (CPU-only builds, e.g. CI, tests/compile/).
CPU_FALLBACK_ARCH = "sm_90"
#: Kernel sources that use architecture-specific instructions (wgmma, setmaxnreg): built for the ``a`` variant of
#: the GPU's architecture (``sm_90a``), whose cubin runs on that architecture only. Every other source is built for
#: the plain one.
ARCH_SPECIFIC_SOURCES = frozenset({"moe_persistent", "probe_weight_read"})


@dataclass(frozen=True)
class BuildResult:
    """A compiled kernel library: ``object_code`` is a ``cuda.core.ObjectCode`` holding the cubin for
    ``arch``; ``signatures`` the parameters of its kernels, read from the source it was compiled from
    (:func:`chunkring.jit.signatures.parse_kernels`)."""

    name: str
    object_code: ObjectCode
    cache_key: str
    cache_hit: bool
    seconds: float
    arch: str
    signatures: dict[str, tuple[Param, ...]]


def arch_of(device: Device) -> str:
    """NVRTC's target for a ``cuda.core.Device``: ``sm_XY`` from its compute capability (a source in
    :data:`ARCH_SPECIFIC_SOURCES` gets its ``a`` variant from :func:`target_arch`)."""
    major, minor = device.compute_capability
    return f"sm_{major}{minor}"


def target_arch(name: str, arch: str) -> str:
    """The target kernel source ``name`` is built for on ``arch``: its architecture-specific variant
    (``sm_90`` -> ``sm_90a``) if the source is in :data:`ARCH_SPECIFIC_SOURCES`, else ``arch`` itself."""
    if name in ARCH_SPECIFIC_SOURCES and not arch.endswith("a"):
        return f"{arch}a"
    return arch


def default_arch() -> str:
    """The current GPU's target, or :data:`CPU_FALLBACK_ARCH` where no GPU (or no driver) is visible."""
    try:
        from cuda.core import Device

        device = Device()
    except Exception:  # no driver library or no device: a CPU-only build
        return CPU_FALLBACK_ARCH
    return arch_of(device)


def kernel_sources() -> list[str]:
    """Names of every kernel translation unit shipped in ``device/kernels``."""
    return sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))


@lru_cache(maxsize=1)
def _nvshmem_include() -> Path:
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("nvshmem")
    if not found:
        raise ChunkringRuntimeError("NVSHMEM headers not found: install nvidia-nvshmem-cu13")
    return Path(found)


@lru_cache(maxsize=1)
def nvshmem_version() -> str:
    """The version of the NVSHMEM headers we compile against, e.g. ``"3.4.5"``."""
    text = (_nvshmem_include() / "non_abi" / "nvshmem_version.h").read_text()
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        tag = f"#define NVSHMEM_VENDOR_{part}_VERSION"
        line = next((ln for ln in text.splitlines() if ln.startswith(tag)), None)
        if line is None:
            raise ChunkringRuntimeError(f"cannot read the NVSHMEM version from {tag}")
        parts.append(line.split()[-1])
    return ".".join(parts)


@lru_cache(maxsize=1)
def include_path() -> tuple[str, ...]:
    from cuda.pathfinder import find_nvidia_header_directory

    dirs = [str(INCLUDE_DIR), str(_nvshmem_include())]
    for lib, wheel in (("cccl", "nvidia-cuda-cccl"), ("cudart", "nvidia-cuda-runtime")):
        found = find_nvidia_header_directory(lib)
        if not found:
            raise ChunkringRuntimeError(f"CUDA {lib} headers not found (needed by NVRTC): install a CUDA 13 "
                                        f"toolkit, or the {wheel} wheel")
        dirs.append(found)
    return tuple(dirs)


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ChunkringRuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


@lru_cache(maxsize=1)
def _nvrtc_identity() -> str:
    """NVRTC's version and the size of the library that answers: nvrtcVersion says nothing of a patch release,
    whose compiler can still emit another cubin (hashing the 140 MB library at every build would cost more)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    library = load_nvidia_dynamic_lib("nvrtc").abs_path
    size = os.path.getsize(library) if library is not None and os.path.isfile(library) else 0
    return f"{nvrtc_version()} ({size} bytes)"


def _tree_digest(root: Path, patterns: tuple[str, ...], *, recursive: bool = True) -> str:
    digest = hashlib.sha256()
    for pattern in patterns:
        for path in sorted(root.rglob(pattern) if recursive else root.glob(pattern)):
            if path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


#: CCCL's version header, relative to its include directory: a CCCL release changes it (its whole tree is
#: thousands of headers, too many to hash at every build).
CCCL_VERSION_HEADER = Path("cuda/std/__cccl/version.h")


@lru_cache(maxsize=4)
def headers_digest(include_dirs: tuple[str, ...]) -> str:
    """A hash of every header NVRTC may read from ``include_dirs`` (:func:`include_path`: ours, NVSHMEM's, CCCL's,
    the CUDA runtime's) that can change a cubin: ours and NVSHMEM's whole, the CUDA runtime's top-level ones
    (cuda_bf16.h, cuda_fp8.h, ...) and CCCL's version header."""
    ours, nvshmem, cccl, cudart = (Path(d) for d in include_dirs)
    return (_tree_digest(ours, ("*.cuh",)) + _tree_digest(nvshmem, ("*.h", "*.cuh"))
            + _tree_digest(cudart, ("*.h", "*.hpp"), recursive=False)
            + hashlib.sha256((cccl / CCCL_VERSION_HEADER).read_bytes()).hexdigest())


def _check_defines(defines: dict[str, int | str]) -> None:
    for key, value in defines.items():
        if not key.isidentifier() or not key.isupper():
            raise ChunkringUsageError(f"macro name {key!r} must be an upper-case identifier", field="defines")
        if not isinstance(value, int) and not str(value).isidentifier():
            raise ChunkringUsageError(f"macro {key} value {value!r} must be an int or identifier", field="defines")


def program_options(name: str, *, defines: dict[str, int | str] | None = None,
                    arch: str | None = None) -> ProgramOptions:
    """The ``cuda.core.ProgramOptions`` that :func:`build` compiles ``<name>.cu`` with, for ``arch`` (by default
    :func:`default_arch`) or its architecture-specific variant (:func:`target_arch`)."""
    from cuda.core import ProgramOptions

    arch = default_arch() if arch is None else arch
    if not arch.startswith("sm_") or not arch[3:].removesuffix("a").isdigit():
        raise ChunkringUsageError(f"arch must look like 'sm_90' or 'sm_90a', got {arch!r}", field="arch")
    arch = target_arch(name, arch)
    defines = dict(sorted((defines or {}).items()))
    _check_defines(defines)
    return ProgramOptions(
        name=f"{name}.cu",
        std="c++17",
        arch=arch,
        include_path=list(include_path()),
        define_macro=["__NVSHMEM_NUMBA_SUPPORT__"] + [f"{k}={v}" for k, v in defines.items()],
        device_as_default_execution_space=True,
        # Spin-waits must not be optimised into assumptions; -O3 is the default and fine with asm volatile.
        ptxas_options=["-O3"],
    )


def build(name: str, *, defines: dict[str, int | str] | None = None, arch: str | None = None) -> BuildResult:
    """Compile ``device/kernels/<name>.cu`` (or load it from the cache) and return its cubin, for
    ``arch`` (``"sm_90"``; by default :func:`default_arch`: the current GPU's), or its ``a`` variant for a source in
    :data:`ARCH_SPECIFIC_SOURCES` (the result's ``arch`` says which)."""
    if name not in kernel_sources():
        raise ChunkringUsageError(f"unknown kernel source {name!r}; have {kernel_sources()}", field="name")
    options = program_options(name, defines=defines, arch=arch)
    source = (KERNEL_DIR / f"{name}.cu").read_text()
    # Read before compiling: a signature the launches cannot map fails the build, cache hit or not.
    signatures = parse_kernels(source, f"{name}.cu")
    key = cache_key(name, source, options)
    path = cache_dir() / f"{name}-{options.arch}-{key}.cubin"

    from cuda.core import ObjectCode

    start = time.perf_counter()
    cubin = _read_cached(path)
    hit = cubin is not None
    if cubin is None:
        cubin = _compile(source, options)
        _write_atomically(path, cubin)
    return BuildResult(name, ObjectCode.from_cubin(cubin), key, hit, time.perf_counter() - start, options.arch,
                       signatures)


def cache_key(name: str, source: str, options: ProgramOptions) -> str:
    """The cache key of kernel ``name`` compiled from ``source`` with ``options`` (what :func:`build` names
    its cubin by): a hash of the name, the source, the headers' contents (:func:`headers_digest`), the NVSHMEM
    version, NVRTC's (:func:`_nvrtc_identity`) and every option as NVRTC receives it."""
    material = [name, source, headers_digest(include_path()), nvshmem_version(), _nvrtc_identity(),
                *(flag.decode() for flag in options.as_bytes("nvrtc"))]
    return hashlib.sha256("\n".join(material).encode()).hexdigest()[:32]


def _compile(source: str, options: ProgramOptions) -> bytes:
    from cuda.core import Program

    try:
        code = Program(source, "c++", options).compile("cubin")
    except Exception as exc:  # cuda.core raises its own error types; the log is in the message
        raise ChunkringRuntimeError(f"NVRTC failed to compile {options.name} for {options.arch}:\n{exc}") from exc
    return bytes(code.code)


def _read_cached(path: Path) -> bytes | None:
    """The cached cubin at ``path``, or None: absent, or unreadable here (another user's cache directory, say) -
    then this process compiles its own."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    # Several ranks compile the same kernel at once; each writes a private temp file and renames it
    # into place, so a reader never sees a partial cubin and the last writer wins harmlessly.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600: others sharing the cache directory read it, not write it
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
