"""Compile chunkring's CUDA C++ kernels at run time with NVRTC, cached on disk.

Why NVRTC (route A in docs/BUILD.md): it needs no CUDA toolkit on the serving machine (the compiler
is a pip wheel), compiles NVSHMEM's device API header-only in one step, and runs without a GPU, so CI
compiles exactly what the GPU host will load.

The cache key covers everything that can change the cubin: the kernel source, every chunkring header,
the NVSHMEM version and headers, the NVRTC version, the target architecture and the options.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from chunkring.env import cache_dir
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

__all__ = ["KERNEL_DIR", "INCLUDE_DIR", "BuildResult", "build", "kernel_sources", "nvshmem_version"]

def _device_dir() -> Path:
    """The ``device/`` tree: CUDA headers and kernels only, installed as the data package
    ``chunkring.device``; an editable install of the repository reads the checkout's ``device/``
    (setuptools' editable finder cannot import a data-only subpackage mapped outside ``runtime/``)."""
    spec = importlib.util.find_spec("chunkring.device")
    candidates = list(spec.submodule_search_locations or []) if spec is not None else []
    candidates.append(str(Path(__file__).resolve().parents[2] / "device"))
    for candidate in candidates:
        if (Path(candidate) / "kernels").is_dir():
            return Path(candidate).resolve()
    raise ChunkringRuntimeError(f"chunkring's CUDA sources (device/kernels) not found in {candidates}")


DEVICE_DIR = _device_dir()
KERNEL_DIR = DEVICE_DIR / "kernels"
INCLUDE_DIR = DEVICE_DIR / "include"
DEFAULT_ARCH = "sm_90"


@dataclass(frozen=True)
class BuildResult:
    """A compiled kernel library: ``object_code`` is a ``cuda.core.ObjectCode`` holding the cubin."""

    name: str
    object_code: object
    cache_key: str
    cache_hit: bool
    seconds: float


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
def _include_path() -> tuple[str, ...]:
    from cuda.pathfinder import find_nvidia_header_directory

    dirs = [str(INCLUDE_DIR), str(_nvshmem_include())]
    for lib in ("cccl", "cudart"):
        found = find_nvidia_header_directory(lib)
        if not found:
            raise ChunkringRuntimeError(f"CUDA {lib} headers not found (needed by NVRTC)")
        dirs.append(found)
    return tuple(dirs)


@lru_cache(maxsize=1)
def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ChunkringRuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


def _tree_digest(root: Path, patterns: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for pattern in patterns:
        for path in sorted(root.rglob(pattern)):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _headers_digest() -> str:
    return _tree_digest(INCLUDE_DIR, ("*.cuh",)) + _tree_digest(_nvshmem_include(), ("*.h", "*.cuh"))


def _check_defines(defines: dict[str, int | str]) -> None:
    for key, value in defines.items():
        if not key.isidentifier() or not key.isupper():
            raise ChunkringUsageError(f"macro name {key!r} must be an upper-case identifier", field="defines")
        if not isinstance(value, int) and not str(value).isidentifier():
            raise ChunkringUsageError(f"macro {key} value {value!r} must be an int or identifier", field="defines")


def build(name: str, *, defines: dict[str, int | str] | None = None, arch: str = DEFAULT_ARCH) -> BuildResult:
    """Compile ``device/kernels/<name>.cu`` (or load it from the cache) and return its cubin."""
    if name not in kernel_sources():
        raise ChunkringUsageError(f"unknown kernel source {name!r}; have {kernel_sources()}", field="name")
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        raise ChunkringUsageError(f"arch must look like 'sm_90', got {arch!r}", field="arch")
    defines = dict(sorted((defines or {}).items()))
    _check_defines(defines)
    source = (KERNEL_DIR / f"{name}.cu").read_text()
    macros = ["__NVSHMEM_NUMBA_SUPPORT__"] + [f"{k}={v}" for k, v in defines.items()]
    key_material = "\n".join(
        [name, source, _headers_digest(), nvshmem_version(), _nvrtc_version(), arch, *macros]
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()[:32]
    path = cache_dir() / f"{name}-{arch}-{key}.cubin"

    from cuda.core import ObjectCode

    start = time.perf_counter()
    if path.exists():
        cubin = path.read_bytes()
        return BuildResult(name, ObjectCode.from_cubin(cubin), key, True, time.perf_counter() - start)
    cubin = _compile(name, source, macros, arch)
    _write_atomically(path, cubin)
    return BuildResult(name, ObjectCode.from_cubin(cubin), key, False, time.perf_counter() - start)


def _compile(name: str, source: str, macros: list[str], arch: str) -> bytes:
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(
        name=f"{name}.cu",
        std="c++17",
        arch=arch,
        include_path=list(_include_path()),
        define_macro=macros,
        device_as_default_execution_space=True,
        # Spin-waits must not be optimised into assumptions; -O3 is the default and fine with asm volatile.
        ptxas_options=["-O3"],
    )
    try:
        code = Program(source, "c++", options).compile("cubin")
    except Exception as exc:  # cuda.core raises its own error types; the log is in the message
        raise ChunkringRuntimeError(f"NVRTC failed to compile {name}.cu for {arch}:\n{exc}") from exc
    return bytes(code.code)


def _write_atomically(path: Path, data: bytes) -> None:
    # Several ranks compile the same kernel at once; each writes a private temp file and renames it
    # into place, so a reader never sees a partial cubin and the last writer wins harmlessly.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
