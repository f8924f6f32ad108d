"""The persistent decode consumer's kernel (device/kernels/moe_persistent.cu) as NVRTC builds it, no GPU needed:

* it is an architecture-specific source, built through chunkring.jit for sm_90a (and cached), which the plain sm_90
  target refuses (wgmma, setmaxnreg);
* its PTX holds the Hopper pieces it is made of - swap-AB FP8 WGMMA at N = 8 to 64, the 5-D tensor copy that
  interleaves w13's gate and up rows, 2-D tensor copies, the scales' bulk copy, transaction barriers, the register
  trade, the L1 -> L2 counters with their proxy fences, the dependent launch's wait and release - and no call
  (ptxas serialises every WGMMA of a kernel that holds one, warning C7510; printf is one);
* ptxas gives it the whole register file at 384 threads (the premise of setmaxnreg) with no stack frame and no spills,
  and its static shared memory leaves the default variant's ring room on an H100/H200 (227 KB a block)."""

import re

import pytest

from chunkring.jit import build
from chunkring.jit.compiler import ARCH_SPECIFIC_SOURCES
from chunkring.moe._engine.persistent import STATIC_SHARED, PersistentVariant
from tests.helpers.nvrtc import ptx_of, ptxas_report

SOURCE = "moe_persistent"
#: The shared memory a block may opt in to on the H100 and H200.
SHARED_LIMIT = 232448


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHUNKRING_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


@pytest.fixture(scope="module")
def ptx() -> str:
    return ptx_of(SOURCE)


def test_it_builds_for_the_a_target_through_the_jit_layer():
    assert SOURCE in ARCH_SPECIFIC_SOURCES
    first = build(SOURCE)
    assert first.arch == "sm_90a" and first.object_code.code[:4] == b"\x7fELF"
    assert set(first.signatures) == {"moe_persistent_gemm"}
    again = build(SOURCE)
    assert again.cache_hit and again.cache_key == first.cache_key


def test_the_plain_target_refuses_it():
    with pytest.raises(Exception, match="wgmma|setmaxnreg"):
        ptxas_report(SOURCE, "sm_90")


def test_its_ptx_holds_the_hopper_pieces_and_no_call(ptx):
    for n in (8, 16, 32, 64):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3" in ptx, n
    assert "m64n128k32" not in ptx, "token tiles stop at 64 rows"
    for instruction in ("wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
                        "wgmma.wait_group.sync.aligned 0",
                        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                        "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64", "mbarrier.try_wait.parity.acquire",
                        "prefetch.tensormap", "setmaxnreg.dec.sync.aligned.u32 56",
                        "setmaxnreg.inc.sync.aligned.u32 224", "bar.sync", "red.release.gpu.global.add.u32",
                        "ld.acquire.gpu.u32", "atom.acq_rel.gpu.global.add.u32", "st.relaxed.gpu.u32",
                        "fence.proxy.async.global", "st.relaxed.sys.u64", "trap;", "griddepcontrol.wait",
                        "griddepcontrol.launch_dependents"):
        assert instruction in ptx, instruction
    assert not re.search(r"\bcall(\.uni)?\b", ptx) and "vprintf" not in ptx
    # four tensor maps, 128-byte by-value parameters aligned to 64 (__grid_constant__: never copied)
    assert len(re.findall(r"\.param \.align 64 \.b8 moe_persistent_gemm_param_\d+\[128\]", ptx)) == 4


def test_it_holds_the_register_file_with_no_spill_in_its_steps_or_serialised_wgmma():
    log = ptxas_report(SOURCE, "sm_90a")
    assert "C7510" not in log and "serialized" not in log, log
    section = log[log.index("Function properties for moe_persistent_gemm"):]
    frame, stores, loads = map(int, re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section).groups())
    registers = int(re.search(r"Used (\d+) registers", section).group(1))
    static_shared = int(re.search(r"(\d+) bytes smem", section).group(1))
    assert registers == 168  # 65,536 / 384 rounded down to 8: setmaxnreg's pool
    # A few words spill where nothing is timed: the SASS (cuobjdump -sass) stores them before the first unit and loads
    # them on the fault sites (a block about to trap), once per pass (after its release) and at each unit's hand-over;
    # the steps' loops touch no local memory. More than this means the math itself spills.
    assert frame <= 32 and stores <= 64 and loads <= 128, (frame, stores, loads)
    assert static_shared <= STATIC_SHARED, "the barriers, the active-expert list and the math's times"
    assert PersistentVariant().shared_bytes() + static_shared <= SHARED_LIMIT
