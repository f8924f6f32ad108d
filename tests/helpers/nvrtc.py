"""A kernel source's PTX and ptxas report as NVRTC makes them from the build's own options (no GPU, no driver): what
the compile tests read instructions, parameters and resources from."""

from __future__ import annotations

import dataclasses
import io

from chunkring.jit.compiler import KERNEL_DIR, program_options

__all__ = ["ptx_of", "ptxas_report"]


def ptx_of(name: str) -> str:
    """``<name>.cu``'s PTX for the virtual target of its build (compute_90, or compute_90a for an
    architecture-specific source), through NVRTC directly (cuda.core's PTX route asks for a driver)."""
    from cuda.bindings import nvrtc

    options = program_options(name, arch="sm_90")
    options = dataclasses.replace(options, arch=options.arch.replace("sm_", "compute_"), ptxas_options=None)
    flags = options.as_bytes("nvrtc")
    err, program = nvrtc.nvrtcCreateProgram((KERNEL_DIR / f"{name}.cu").read_bytes(), f"{name}.cu".encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        _, size = nvrtc.nvrtcGetPTXSize(program)
        text = b" " * size
        nvrtc.nvrtcGetPTX(program, text)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return text.decode(errors="replace")


def ptxas_report(name: str, arch: str) -> str:
    """ptxas's report (-v) of ``<name>.cu`` built for ``arch`` (the build's options otherwise)."""
    from cuda.core import Program

    options = dataclasses.replace(program_options(name, arch="sm_90"), arch=arch, ptxas_options=["-O3", "-v"])
    log = io.StringIO()
    Program((KERNEL_DIR / f"{name}.cu").read_text(), "c++", options).compile("cubin", logs=log)
    return log.getvalue().replace("\0", "")
