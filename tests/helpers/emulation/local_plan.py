"""moe_stream.cu's one-rank plan, moe_local_route and moe_local_scatter, run on the CPU as written, over
tests/helpers/emulation/ring.py's heap and status words with pull.py's checks (chunk_extent, checked_chunk_rows,
checked_expert, checked_scale, check_stage) and decode.py's group_offsets (tests/unit/test_local_plan_emulation.py
holds them to the publish's and the pull's reference for the stage and to the documented plan layout).

A warp's loop iterations run in an order drawn from ``order_seed``, lanes in lane order, as plan.py's scatter: rows
land in their groups in some order a GPU may take, and nothing may depend on it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.decode import group_offsets
from tests.helpers.emulation.machine import WARP, Allocation, Pointer, read_struct
from tests.helpers.emulation.plan import STRUCTS, warp_copy16
from tests.helpers.emulation.pull import check_stage, checked_chunk_rows, checked_expert, checked_scale, chunk_extent
from tests.helpers.emulation.ring import RingView

__all__ = ["kernels"]


def local_call(ring: RingView, s, a, report: bool) -> tuple[int, bool]:
    """moe_stream.cu local_call: (rows below the call's extent, checked; whether the descriptors agree)."""
    if not ring.rank.check_descriptor() or not check_stage(ring, s):
        return 0, False
    call = SimpleNamespace(n_tokens=a.n_tokens, end_of_stream=1, valid_tokens=a.valid_tokens, batch_rows=a.n_tokens,
                           token_base=0)
    e = chunk_extent(ring, call, report)
    _, n = checked_chunk_rows(ring, s, ring.d.my_pe, 0, SimpleNamespace(token_base=0, num_tokens=e.n), report)
    return n, True


class _Shared:
    """Shared-memory words that group_offsets' emulation reads as it reads counts."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = words

    def load_as(self, dtype, element: int, what: str):
        return dtype(self.words[element])


def moe_local_route(ring: RingView, a, part: int, parts: int, block: int):
    """The one block: the call's routing checked into the stage (its rows past the extent -1), every choice of a
    local expert counted, the groups' offsets scanned, counts / group_end / cursors written whole."""
    assert parts == 1, "moe_local_route is one block"
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    n, ok = local_call(ring, s, a, True)
    num_local = s.expert_hi - s.expert_lo
    totals = np.zeros(num_local, np.int64)
    if ok:
        src, K = ring.d.my_pe, s.topk
        rows = min(a.n_tokens, s.token_capacity)
        idx = Pointer(ring.memory, s.idx + 4 * src * s.token_capacity * K, "stage idx")
        w = Pointer(ring.memory, s.w + 4 * src * s.token_capacity * K, "stage w")
        for i in range(rows * K):
            expert = -1
            if i < n * K:
                expert = checked_expert(ring, src, 0, i // K, i % K, int(a.topk_idx.load_as(np.int32, i, "topk_idx")))
                w.store_as(np.float32, i, a.topk_weights.load_as(np.float32, i, "topk_weights"), "stage w")
            idx.store_as(np.int32, i, expert, "stage idx")
            if 0 <= expert - s.expert_lo < num_local:
                totals[expert - s.expert_lo] += 1
    offsets = group_offsets(_Shared(totals), num_local, a.block_m, block, 4 * (2 * num_local + 1))
    e_all = np.arange(num_local)
    a.counts.store_as(np.uint32, e_all, totals, "counts")
    a.group_end.store_as(np.int32, e_all, np.array(offsets[:num_local], np.int64) + totals, "group_end")
    a.cursors.store_as(np.uint32, e_all, 0, "cursors")
    yield from ()


def moe_local_scatter(ring: RingView, a, part: int, parts: int, block: int, order_seed: int = 0):
    """Block ``part`` of ``parts``: its grid-stride share of the plan rows no choice takes (source -1), then its share
    of the call's rows, a warp per row: scales checked once, each local choice into the next row of its group."""
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    num_local = s.expert_hi - s.expert_lo
    offsets = group_offsets(a.counts, num_local, a.block_m, block, 4 * (num_local + 1))
    counts = a.counts.load_as(np.uint32, np.arange(num_local), "counts").astype(np.int64)
    r = _grid_stride(part, parts, block, a.plan_rows)
    group = np.searchsorted(np.array(offsets[:num_local]), r, side="right") - 1  # the last group starting at or before
    padding = (r >= offsets[num_local]) | (r >= np.array(offsets[:num_local])[group] + counts[group])
    a.row_src.store_as(np.int32, r[padding], -1, "row_src")
    n, ok = local_call(ring, s, a, False)
    if not ok:
        return
    src, K = ring.d.my_pe, s.topk
    lo, hi = n * part // parts, n * (part + 1) // parts
    idx = Pointer(ring.memory, s.idx + 4 * src * s.token_capacity * K, "stage idx")
    w = Pointer(ring.memory, s.w + 4 * src * s.token_capacity * K, "stage w")
    row_bytes, sf_floats = ring.d.x_row_bytes, ring.d.x_sf_row_floats
    x = Pointer(ring.memory, _address(a.x), "x")
    warps = block // WARP
    items = [(warp, row) for warp in range(warps) for row in range(lo + warp, hi, warps)]
    for i in np.random.default_rng(order_seed + part).permutation(len(items)):
        _, row = items[i]
        choices = idx.load_as(np.int32, np.arange(row * K, (row + 1) * K), "stage idx").astype(np.int64)
        local = (choices >= s.expert_lo) & (choices < s.expert_hi)
        if not local.any():  # routed_here
            a.own_row.store_as(np.int32, np.arange(row * K, (row + 1) * K), -1, "own_row")
            continue
        scales = [a.x_sf.load_as(np.float32, row * sf_floats + j, "x_sf") for j in range(sf_floats)]
        for j, value in enumerate(scales):
            checked_scale(ring, src, 0, row, j, value)
        for k in range(K):  # lanes in lane order: each choice's cursor, then the warp's copies
            e = int(choices[k] - s.expert_lo)
            if not local[k]:
                a.own_row.store_as(np.int32, row * K + k, -1, "own_row")
                continue
            p = offsets[e] + int(a.cursors.atomic_add_as(np.uint32, e, 1, "cursors"))
            a.own_row.store_as(np.int32, row * K + k, p, "own_row")
            a.row_src.store_as(np.int32, p, src, "row_src")
            a.row_token.store_as(np.int32, p, row, "row_token")
            a.row_k.store_as(np.int32, p, k, "row_k")
            a.row_weight.store_as(np.float32, p, w.load_as(np.float32, row * K + k, "stage w"), "row_weight")
            warp_copy16(a.rows, p * row_bytes, x, row * row_bytes, row_bytes)
            for j, value in enumerate(scales):
                a.rows_sf.store_as(np.float32, j * a.sf_stride + p,
                                   checked_scale(ring, src, 0, row, j, value, report=False), "rows_sf")
    yield from ()


def _grid_stride(part: int, parts: int, block: int, total: int) -> np.ndarray:
    """The indices block ``part``'s threads take in a grid-stride loop over ``total``."""
    first = part * block + np.arange(block)
    return np.concatenate([np.arange(f, total, parts * block) for f in first]) if total else np.zeros(0, np.int64)


def _address(pointer) -> int:
    """Where a kernel argument points: an Allocation's base or a Pointer's address."""
    return pointer.base if isinstance(pointer, Allocation) else pointer.address


def kernels(heap, streams, order_seed: int = 0) -> dict:
    """The two kernels by name, as World's ``launchers`` take them: each block a generator with its own RingView."""
    def launcher(kernel):
        return lambda memory, grid, block, a: [kernel(RingView(memory, heap, streams, a.desc, b), a, b, grid, block)
                                               for b in range(grid)]

    return {"moe_local_route": launcher(moe_local_route),
            "moe_local_scatter": launcher(lambda *args: moe_local_scatter(*args, order_seed=order_seed))}
