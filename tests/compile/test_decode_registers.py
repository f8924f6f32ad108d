"""The decode kernels (device/kernels/moe_decode.cu) keep their load pipeline in registers: ptxas, run as the
build runs it (NVRTC, sm_90) with its report on, places no stack frame and spills nothing, and the register
count leaves one 256-thread block per SM (the launch bounds). A deeper pipeline or a wider pass that spills would
turn the weight stream's loads-in-flight into local-memory traffic, which only a GPU profile would show."""

import dataclasses
import io
import re

import pytest

from chunkring.jit.compiler import KERNEL_DIR, program_options


@pytest.fixture(scope="module")
def ptxas_report():
    from cuda.core import Program

    options = dataclasses.replace(program_options("moe_decode", arch="sm_90"), ptxas_options=["-O3", "-v"])
    log = io.StringIO()
    Program((KERNEL_DIR / "moe_decode.cu").read_text(), "c++", options).compile("cubin", logs=log)
    return log.getvalue()


@pytest.mark.parametrize("kernel", ["moe_decode_l1", "moe_decode_l2"])
def test_the_decode_kernels_do_not_spill(ptxas_report, kernel):
    section = ptxas_report[ptxas_report.index(f"Function properties for {kernel}"):]
    frame, stores, loads = map(int, re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section).groups())
    registers = int(re.search(r"Used (\d+) registers", section).group(1))
    assert (frame, stores, loads) == (0, 0, 0), f"{kernel}: stack frame / spills {frame} / {stores} / {loads} bytes"
    assert registers * 256 <= 65536, f"{kernel}: {registers} registers leave no room for a 256-thread block"
