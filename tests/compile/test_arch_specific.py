"""Kernel sources with architecture-specific instructions (chunkring.jit.compiler.ARCH_SPECIFIC_SOURCES) are built for
the GPU's ``a`` target, and need it: device/kernels/probe_weight_read.cu, the weight loader of the planned persistent
decode consumer alone, trades registers between warpgroups with ``setmaxnreg``, which the plain sm_90 target refuses.
Its PTX holds the copy engine's tensor-map and bulk copies and the transaction barriers they complete on, and ptxas
gives it the whole register file at 384 threads (the premise of setmaxnreg), without spills. No GPU needed."""

import dataclasses
import io
import re

import pytest

from chunkring.jit import build
from chunkring.jit.compiler import ARCH_SPECIFIC_SOURCES, KERNEL_DIR, program_options, target_arch

PROBE = "probe_weight_read"


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHUNKRING_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def compile_probe(arch: str, ptxas_options: list[str] | None = None) -> str:
    """The probe's cubin for ``arch`` built with ``ptxas_options``; returns the compiler's log."""
    from cuda.core import Program

    options = dataclasses.replace(program_options(PROBE, arch="sm_90"), arch=arch, ptxas_options=ptxas_options)
    log = io.StringIO()
    Program((KERNEL_DIR / f"{PROBE}.cu").read_text(), "c++", options).compile("cubin", logs=log)
    return log.getvalue()


def probe_ptx() -> str:
    """The probe's PTX for compute_90a, through NVRTC directly (cuda.core's PTX route asks for a driver)."""
    from cuda.bindings import nvrtc

    options = dataclasses.replace(program_options(PROBE, arch="sm_90"), arch="compute_90a", ptxas_options=None)
    flags = options.as_bytes("nvrtc")
    err, program = nvrtc.nvrtcCreateProgram((KERNEL_DIR / f"{PROBE}.cu").read_bytes(), f"{PROBE}.cu".encode(), 0, [],
                                            [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        _, size = nvrtc.nvrtcGetPTXSize(program)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(program, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return ptx.decode(errors="replace")


def test_an_arch_specific_source_gets_the_a_target():
    assert PROBE in ARCH_SPECIFIC_SOURCES and "moe_decode" not in ARCH_SPECIFIC_SOURCES
    assert target_arch(PROBE, "sm_90") == target_arch(PROBE, "sm_90a") == "sm_90a"
    assert target_arch("moe_decode", "sm_90") == "sm_90"
    assert program_options(PROBE, arch="sm_90").arch == "sm_90a"
    assert build(PROBE).arch == "sm_90a" and build("selftest").arch == "sm_90"


def test_the_plain_target_refuses_the_probe():
    with pytest.raises(Exception, match="setmaxnreg"):
        compile_probe("sm_90")


def test_the_probe_streams_with_the_copy_engine():
    ptx = probe_ptx()
    for instruction in ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64", "mbarrier.try_wait.parity.acquire",
                        "prefetch.tensormap", "setmaxnreg.dec.sync.aligned.u32 40",
                        "setmaxnreg.inc.sync.aligned.u32 232", "%smid"):
        assert instruction in ptx, instruction
    # the tensor maps are 128-byte, 64-aligned by-value parameters (__grid_constant__: never copied to local memory)
    assert len(re.findall(r"\.param \.align 64 \.b8 probe_weight_read_param_\d+\[128\]", ptx)) == 2


def test_the_probe_holds_the_register_file_without_spilling():
    log = compile_probe("sm_90a", ["-O3", "-v"])
    found = {}
    for kernel in ("probe_weight_read", "probe_plain_read"):
        section = log[log.index(f"Function properties for {kernel}"):]
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", section).groups()
        found[kernel] = int(re.search(r"Used (\d+) registers", section).group(1)), tuple(map(int, spills))
    assert found["probe_weight_read"] == (168, (0, 0))  # 65,536 / 384, rounded down to 8: setmaxnreg's pool
    assert found["probe_plain_read"][1] == (0, 0) and found["probe_plain_read"][0] <= 64  # two 512-thread blocks
