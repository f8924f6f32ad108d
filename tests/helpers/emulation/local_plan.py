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
from tests.helpers.emulation.machine import Allocation, Pointer, read_struct
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


def moe_local_route(ring: RingView, a, part: int, parts: int, block: int, order_seed: int = 0):
    """The one block: the call's routing checked into the stage (its rows past the extent -1); each local choice's
    rank among its expert's choices (shared-memory atomics, in an order drawn from ``order_seed``) parked in own_row;
    the groups' offsets scanned; each such choice's plan row in own_row with its source, token, k and weight there,
    -1 for the call's other choices; each group's padding rows source -1; counts and group_end written whole."""
    assert parts == 1, "moe_local_route is one block"
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    n, ok = local_call(ring, s, a, True)
    num_local = s.expert_hi - s.expert_lo
    totals = np.zeros(num_local, np.int64)
    src, K = ring.d.my_pe, s.topk
    choices = min(a.n_tokens, s.token_capacity) * K if ok else 0
    idx = Pointer(ring.memory, s.idx + 4 * src * s.token_capacity * K, "stage idx")
    w = Pointer(ring.memory, s.w + 4 * src * s.token_capacity * K, "stage w")
    experts = np.full(choices, -1, np.int64)
    for i in range(choices):
        if i < n * K:
            experts[i] = checked_expert(ring, src, 0, i // K, i % K, int(a.topk_idx.load_as(np.int32, i, "topk_idx")))
            w.store_as(np.float32, i, a.topk_weights.load_as(np.float32, i, "topk_weights"), "stage w")
        idx.store_as(np.int32, i, experts[i], "stage idx")
    for i in np.random.default_rng(order_seed).permutation(choices):  # the atomics, in some order
        e = int(experts[i] - s.expert_lo)
        local = 0 <= e < num_local
        a.own_row.store_as(np.int32, i, totals[e] if local else -1, "own_row")
        if local:
            totals[e] += 1
    offsets = group_offsets(_Shared(totals), num_local, a.block_m, block, 4 * (2 * num_local + 1))
    for i in range(choices):
        rank = int(a.own_row.load_as(np.int32, i, "own_row"))
        if rank < 0:
            continue
        p = offsets[int(idx.load_as(np.int32, i, "stage idx")) - s.expert_lo] + rank
        a.own_row.store_as(np.int32, i, p, "own_row", again=True)  # its thread's own parked rank
        a.row_src.store_as(np.int32, p, src, "row_src")
        a.row_token.store_as(np.int32, p, i // K, "row_token")
        a.row_k.store_as(np.int32, p, i % K, "row_k")
        a.row_weight.store_as(np.float32, p, w.load_as(np.float32, i, "stage w"), "row_weight")
    for e in range(num_local):
        end = offsets[e] + int(totals[e])
        a.row_src.store_as(np.int32, np.arange(end, offsets[e + 1]), -1, "row_src")
    e_all = np.arange(num_local)
    a.counts.store_as(np.uint32, e_all, totals, "counts")
    a.group_end.store_as(np.int32, e_all, np.array(offsets[:num_local], np.int64) + totals, "group_end")
    yield from ()


def moe_local_scatter(ring: RingView, a, part: int, parts: int, block: int, order_seed: int = 0):
    """Block ``part`` of ``parts``: its grid-stride share of the plan rows past the last group (source -1), then its
    share of the call's choices, a warp per choice in some order: each local choice's payload copied into the row
    moe_local_route gave it, its scales checked (reported by the row's first local choice)."""
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    n, ok = local_call(ring, s, a, False)
    num_local = s.expert_hi - s.expert_lo
    last_end = int(a.group_end.load_as(np.int32, num_local - 1, "group_end")) if num_local else 0
    used = -(-last_end // a.block_m) * a.block_m
    a.row_src.store_as(np.int32, used + _grid_stride(part, parts, block, max(0, a.plan_rows - used)), -1, "row_src")
    if not ok:
        return
    src, K = ring.d.my_pe, s.topk
    lo, hi = n * K * part // parts, n * K * (part + 1) // parts
    row_bytes, sf_floats = ring.d.x_row_bytes, ring.d.x_sf_row_floats
    x = Pointer(ring.memory, _address(a.x), "x")
    for i in lo + np.random.default_rng(order_seed + part).permutation(hi - lo):
        p = int(a.own_row.load_as(np.int32, i, "own_row"))
        if p < 0:
            continue
        row, k = divmod(int(i), K)
        earlier = any(int(a.own_row.load_as(np.int32, row * K + j, "own_row")) >= 0 for j in range(k))
        warp_copy16(a.rows, p * row_bytes, x, row * row_bytes, row_bytes)
        for j in range(sf_floats):
            value = a.x_sf.load_as(np.float32, row * sf_floats + j, "x_sf")
            a.rows_sf.store_as(np.float32, j * a.sf_stride + p,
                               checked_scale(ring, src, 0, row, j, value, report=not earlier), "rows_sf")
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

    return {"moe_local_route": launcher(lambda *args: moe_local_route(*args, order_seed=order_seed)),
            "moe_local_scatter": launcher(lambda *args: moe_local_scatter(*args, order_seed=order_seed))}
