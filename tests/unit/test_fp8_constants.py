"""The host's FP8 quantisers (chunkring.moe.routing, chunkring.moe.weights, the fp64 reference) and the kernels'
(device/include/chunkring/moe/fp8.cuh) share e4m3's range and the 1x128 scale block: a row quantised on either
side has the same scales."""

import re
from pathlib import Path

import torch

from chunkring.ring.spec import E4M3_MAX

DEVICE = Path(__file__).resolve().parents[2] / "device"


def test_the_host_and_the_kernels_share_e4m3s_range():
    source = (DEVICE / "include" / "chunkring" / "moe" / "fp8.cuh").read_text()
    assert float(re.search(r"constexpr float kE4M3Max = ([\d.]+)f;", source).group(1)) == E4M3_MAX
    assert E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max


def test_no_kernel_keeps_its_own_copy_of_the_fp8_arithmetic():
    for path in (DEVICE / "kernels").glob("*.cu"):
        text = path.read_text()
        assert "kE4M3Max =" not in text, path.name  # the range: fp8.cuh's
        assert "__expf(-" not in text, path.name  # SwiGLU: fp8.cuh's silu_mul

