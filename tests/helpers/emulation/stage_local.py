"""moe_stream.cu's moe_stage_local run on the CPU as written, over tests/helpers/emulation/ring.py's heap and status
words with pull.py's checks (chunk_extent, checked_chunk_rows, checked_expert, checked_scale, check_stage): a one-rank
call's rows from the caller's tensors into the stage (tests/unit/test_ring_pull_emulation.py holds it to the
publish's and the pull's reference)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.machine import Allocation, Pointer, read_struct
from tests.helpers.emulation.plan import STRUCTS
from tests.helpers.emulation.pull import check_stage, checked_chunk_rows, checked_expert, checked_scale, chunk_extent
from tests.helpers.emulation.ring import RingView, copy

__all__ = ["moe_stage_local"]


def moe_stage_local(ring: RingView, a, part: int, parts: int):
    """Block ``part`` of ``parts``: its share of a one-rank call's rows from the caller's tensors into the stage at
    source my_pe, checked and reported as the pull checks them (slot 0), the extent as the publish takes it."""
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    if not ring.rank.check_descriptor() or not check_stage(ring, s):
        return
    d, K, src, slot = ring.d, ring.d.topk, ring.d.my_pe, 0
    call = SimpleNamespace(n_tokens=a.n_tokens, end_of_stream=1, valid_tokens=a.valid_tokens, batch_rows=a.n_tokens,
                           token_base=0)
    e = chunk_extent(ring, call, part == 0)
    _, n = checked_chunk_rows(ring, s, src, slot, SimpleNamespace(token_base=0, num_tokens=e.n), part == 0)
    lo, hi = n * part // parts, n * (part + 1) // parts
    first_row = src * s.token_capacity
    idx = Pointer(ring.memory, s.idx + 4 * first_row * K, "stage idx")
    w = Pointer(ring.memory, s.w + 4 * first_row * K, "stage w")
    for i in range(lo * K, hi * K):
        expert = checked_expert(ring, src, slot, i // K, i % K, int(a.topk_idx.load_as(np.int32, i, "topk_idx")))
        idx.store_as(np.int32, i, expert, "stage idx")
        w.store_as(np.float32, i, a.topk_weights.load_as(np.float32, i, "topk_weights"), "stage w")
    row_bytes, sf = d.x_row_bytes, d.x_sf_row_floats
    for row in range(lo, hi):  # a warp per row
        choices = idx.load_as(np.int32, np.arange(row * K, (row + 1) * K), "stage idx")
        if not ((choices >= s.expert_lo) & (choices < s.expert_hi)).any():
            continue
        copy(ring.memory, s.x + (first_row + row) * row_bytes, _address(a.x) + row * row_bytes, row_bytes, "x", 16)
        scales = Pointer(ring.memory, s.sf + 4 * (first_row + row) * sf, "stage sf")
        for i in range(sf):
            value = checked_scale(ring, src, slot, row, i, a.x_sf.load_as(np.float32, row * sf + i, "x_sf"))
            scales.store_as(np.float32, i, value, "stage sf")
    yield from ()


def _address(pointer) -> int:
    """Where a kernel argument points: an Allocation's base or a Pointer's address."""
    return pointer.base if isinstance(pointer, Allocation) else pointer.address
