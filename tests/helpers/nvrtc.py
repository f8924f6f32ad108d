"""A kernel source's PTX and ptxas report as NVRTC makes them from the build's own options (no GPU, no driver): what
the compile tests read instructions, parameters, layouts and resources from."""

from __future__ import annotations

import dataclasses
import io

import pytest

from chunkring.jit.compiler import KERNEL_DIR, program_options

__all__ = ["nvrtc_ptx", "ptx_of", "ptxas_report", "virtual_options"]


def virtual_options(name: str):
    """The build's options for ``<name>.cu`` (its include paths and language options) at the virtual target of its
    sm_90 build: compute_90, or compute_90a for an architecture-specific source; no ptxas."""
    options = program_options(name, arch="sm_90")
    return dataclasses.replace(options, arch=options.arch.replace("sm_", "compute_"), ptxas_options=None)


def nvrtc_ptx(source: bytes, filename: str, options) -> str:
    """``source``'s PTX through NVRTC directly (cuda.core's PTX route asks for a driver), compiled with ``options``
    (:func:`virtual_options`); fails the test with NVRTC's log where it does not compile."""
    from cuda.bindings import nvrtc

    flags = options.as_bytes("nvrtc")
    err, program = nvrtc.nvrtcCreateProgram(source, filename.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            pytest.fail(f"NVRTC failed on {filename}:\n{log.decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetPTXSize(program)
        text = b" " * size
        nvrtc.nvrtcGetPTX(program, text)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return text.decode(errors="replace")


def ptx_of(name: str) -> str:
    """``<name>.cu``'s PTX for the virtual target of its build (:func:`virtual_options`)."""
    return nvrtc_ptx((KERNEL_DIR / f"{name}.cu").read_bytes(), f"{name}.cu", virtual_options(name))


def ptxas_report(name: str, arch: str | None = None) -> str:
    """ptxas's report (-v) of ``<name>.cu`` built for ``arch`` (default: its build's target for sm_90, sm_90a for an
    architecture-specific source), the build's options otherwise."""
    from cuda.core import Program

    options = program_options(name, arch="sm_90")
    options = dataclasses.replace(options, arch=arch or options.arch, ptxas_options=["-O3", "-v"])
    log = io.StringIO()
    Program((KERNEL_DIR / f"{name}.cu").read_text(), "c++", options).compile("cubin", logs=log)
    return log.getvalue().replace("\0", "")
