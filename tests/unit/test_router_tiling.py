"""The router GEMM's tiling on the host (chunkring.moe.routing.router_slices) mirrors moe_produce.cu's and
depends on the hidden size alone - the precondition of batch-invariant routing, which tests/gpu/test_router.py
checks on the device: every launch for one layer, whatever its token count, splits each logit's sum alike."""

import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from chunkring.moe.routing import ROUTER_MAX_SLICES, ROUTER_SLICE, ROUTER_TILE, router_slices

SOURCE = (Path(__file__).resolve().parents[2] / "device" / "kernels" / "moe_produce.cu").read_text()


def constant(name: str) -> int:
    return int(re.search(rf"constexpr int {name} = (\d+);", SOURCE).group(1))


def test_the_host_mirrors_the_kernels_constants():
    assert (constant("kRouterSlice"), constant("kRouterMaxSlices")) == (ROUTER_SLICE, ROUTER_MAX_SLICES)
    assert (constant("kRouterRows"), constant("kRouterCols")) == ROUTER_TILE  # the launch's grid: one block a tile
    assert ROUTER_SLICE % 16 == 0  # whole MMA k-steps


def test_the_split_takes_a_slice_per_512_columns_up_to_16():
    """The sizes the emulation's cases are named by (1, 3 and 16 slices), and V3's 7,168 (14)."""
    assert [router_slices(h) for h in (128, 512, 513, 1040, 7168, 8192, 8208, 65536)] == [1, 1, 2, 3, 14, 16, 16, 16]


@given(st.integers(1, 64).map(lambda blocks: 128 * blocks))
def test_every_hidden_column_falls_in_one_slice_of_a_fixed_split(hidden):
    slices = router_slices(hidden)
    assert 1 <= slices <= ROUTER_MAX_SLICES
    slice_len = -(-(hidden // 16) // slices) * 16  # the kernel's rule
    assert slice_len * slices >= hidden and slice_len * (slices - 1) < hidden  # no warp without columns
    assert slice_len >= ROUTER_SLICE or slices == -(-hidden // ROUTER_SLICE)
