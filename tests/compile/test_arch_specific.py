"""Kernel sources with architecture-specific instructions (chunkring.jit.compiler.ARCH_SPECIFIC_SOURCES) are built for
the GPU's ``a`` target, and need it: device/kernels/probe_weight_read.cu, the weight loader of the planned persistent
decode consumer alone, trades registers between warpgroups with ``setmaxnreg``, which the plain sm_90 target refuses.
Its PTX holds the copy engine's tensor-map and bulk copies and the transaction barriers they complete on, and ptxas
gives it the whole register file at 384 threads (the premise of setmaxnreg), without spills. No GPU needed."""

import re

import pytest

from chunkring.jit import build
from chunkring.jit.compiler import ARCH_SPECIFIC_SOURCES, program_options, target_arch
from tests.helpers.nvrtc import ptx_of, ptxas_report

PROBE = "probe_weight_read"


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHUNKRING_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def test_an_arch_specific_source_gets_the_a_target():
    assert PROBE in ARCH_SPECIFIC_SOURCES and "moe_decode" not in ARCH_SPECIFIC_SOURCES
    assert target_arch(PROBE, "sm_90") == target_arch(PROBE, "sm_90a") == "sm_90a"
    assert target_arch("moe_decode", "sm_90") == "sm_90"
    assert program_options(PROBE, arch="sm_90").arch == "sm_90a"
    assert build(PROBE).arch == "sm_90a" and build("selftest").arch == "sm_90"


def test_the_plain_target_refuses_the_probe():
    with pytest.raises(Exception, match="setmaxnreg"):
        ptxas_report(PROBE, "sm_90")


def test_the_probe_streams_with_the_copy_engine():
    ptx = ptx_of(PROBE)
    for instruction in ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64", "mbarrier.try_wait.parity.acquire",
                        "prefetch.tensormap", "setmaxnreg.dec.sync.aligned.u32 40",
                        "setmaxnreg.inc.sync.aligned.u32 232", "%smid"):
        assert instruction in ptx, instruction
    # the tensor maps are 128-byte, 64-aligned by-value parameters (__grid_constant__: never copied to local memory)
    assert len(re.findall(r"\.param \.align 64 \.b8 probe_weight_read_param_\d+\[128\]", ptx)) == 2


def test_the_probe_holds_the_register_file_without_spilling():
    log = ptxas_report(PROBE, "sm_90a")
    found = {}
    for kernel in ("probe_weight_read", "probe_plain_read"):
        section = log[log.index(f"Function properties for {kernel}"):]
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", section).groups()
        found[kernel] = int(re.search(r"Used (\d+) registers", section).group(1)), tuple(map(int, spills))
    assert found["probe_weight_read"] == (168, (0, 0))  # 65,536 / 384, rounded down to 8: setmaxnreg's pool
    assert found["probe_plain_read"][1] == (0, 0) and found["probe_plain_read"][0] <= 64  # two 512-thread blocks
