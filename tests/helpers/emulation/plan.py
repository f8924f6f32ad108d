"""The batch plan's kernels run on the CPU as written (tests/unit/test_moe_plan_emulation.py drives them):
moe_plan_count and moe_plan_scatter of device/kernels/moe_experts.cu, with group_offsets (decode.py's) and
util/copy.cuh's warp_copy16, reading the stage through its StageDesc as the kernels do - the descriptor's u64 words
in the order layout/moe_desc.cuh declares them (parsed from the header, not taken from the host's mirror),
require_descriptor's version and size check (a mismatch traps), and every tensor address in it resolved in the
emulated memory where it is dereferenced (tests/helpers/emulation/machine.py: bounds, alignment, initialised bytes,
one store per byte and launch).

Each function mirrors its device function line by line, per warp with numpy arrays over the 32 lanes. The order in
which warps reach their atomics is the hardware's choice: here the warps' loop iterations run in an order drawn
from ``order_seed`` (lanes in lane order inside an iteration), so a test sees rows placed as some run of the GPU
may place them, and nothing may depend on it.

Where it cannot be faithful: anything about timing, memory ordering or caching; the order of a warp's lanes'
atomics on one cursor (lane order here)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.decode import group_offsets
from tests.helpers.emulation.machine import (
    WARP,
    EmulatedMemoryError,
    EmulatedTrap,
    Pointer,
    header_constant,
    header_structs,
    read_struct,
)

__all__ = ["LAYOUT_VERSION", "STRUCTS", "EmulatedTrap", "descriptor", "kernels", "pointer", "warp_copy16"]

#: The descriptors' fields in declaration order, from layout/moe_desc.cuh itself.
STRUCTS = header_structs("chunkring/layout/moe_desc.cuh")
LAYOUT_VERSION = header_constant("chunkring/layout/moe_desc.cuh", "kMoeLayoutVersion")


def descriptor(memory, desc, struct: str) -> SimpleNamespace:
    """``*desc`` as the kernel reads it: every u64 word of the struct; then require_descriptor."""
    s = read_struct(desc, STRUCTS[struct], struct)
    if s.layout_version != LAYOUT_VERSION or s.desc_bytes != 8 * len(STRUCTS[struct]):  # sizeof: u64s only
        raise EmulatedTrap(f"require_descriptor: {struct} version {s.layout_version}, {s.desc_bytes} bytes")
    return s


def pointer(memory, s: SimpleNamespace, field: str) -> Pointer:
    """layout::address<T>(s.field)."""
    return Pointer(memory, getattr(s, field), field)


def warp_copy16(dst, dst_byte: int, src, src_byte: int, nbytes: int) -> None:
    """util::warp_copy16: n = bytes / 16 int4 units, lane l taking units base + u * 32 + l (u < 8), every unit once.
    The kernels' promise that bytes is a multiple of 16 is checked: the tail would be silently dropped."""
    if nbytes % 16:
        raise EmulatedMemoryError(f"warp_copy16: {nbytes} bytes is not a multiple of 16")
    n = nbytes // 16
    for base in range(0, n, 8 * WARP):
        i = base + np.arange(8)[:, None] * WARP + np.arange(WARP)[None, :]  # [u, lane]
        i = i[i < n]
        v = src.load(src_byte + 16 * i, 16, "warp_copy16 load")
        dst.store(dst_byte + 16 * i, v, "warp_copy16 store")


def moe_plan_count(memory, grid, block, shared_bytes, a) -> None:
    s = descriptor(memory, a.stage, "StageDesc")
    stage_idx = pointer(memory, s, "idx")
    choices = s.sources * s.token_capacity * s.topk
    expert_lo, num_local = s.expert_lo, s.expert_hi - s.expert_lo  # static_cast<int>: small here
    threads = np.arange(grid * block, dtype=np.int64)  # blockIdx.x * blockDim.x + threadIdx.x, every block at once
    for start in range(0, choices, grid * block):
        i = start + threads
        i = i[i < choices]
        e = stage_idx.load_as(np.int32, i, "stage idx").astype(np.int64) - expert_lo
        mine = (e >= 0) & (e < num_local)
        a.counts.atomic_add_as(np.uint32, e[mine], 1, "counts")


def moe_plan_scatter(memory, grid, block, shared_bytes, a, order_seed: int = 0) -> None:
    s = descriptor(memory, a.stage, "StageDesc")
    stage_x, stage_sf = pointer(memory, s, "x"), pointer(memory, s, "sf")
    stage_idx, stage_w = pointer(memory, s, "idx"), pointer(memory, s, "w")
    row_bytes, sf_per_row = s.row_bytes, s.sf_per_row
    choices = s.sources * s.token_capacity * s.topk
    expert_lo, num_local = s.expert_lo, s.expert_hi - s.expert_lo
    offsets = group_offsets(a.counts, num_local, a.block_m, block, shared_bytes)  # every block: the same values
    store_group_end(a, offsets, num_local)
    warps = grid * block // WARP
    N, K = s.token_capacity, s.topk
    items = [(warp, step) for warp in range(warps) for step in range(0, choices, WARP * warps)
             if step + warp < choices]  # pass = step // (WARP * warps): while pass * 32 * warps + warp < choices
    lane = np.arange(WARP, dtype=np.int64)
    for n in np.random.default_rng(order_seed).permutation(len(items)):
        warp, step = items[n]
        mine_choice = step + lane * warps + warp  # (pass * 32 + lane) * warps + warp
        live = mine_choice < choices
        e = np.full(WARP, -1, np.int64)
        e[live] = stage_idx.load_as(np.int32, mine_choice[live], "stage idx").astype(np.int64) - expert_lo
        local = (e >= 0) & (e < num_local)
        e[~local] = -1
        row = np.zeros(WARP, np.int64)
        row[local] = np.array(offsets, np.int64)[e[local]] + a.cursors.atomic_add_as(
            np.uint32, e[local], 1, "cursors").astype(np.int64)
        row %= 2**32  # unsigned
        for src_lane in np.flatnonzero(e >= 0):  # __ballot_sync, then __ffs: ascending lanes
            choice = int(mine_choice[src_lane])
            p = int(row[src_lane])  # __shfl_sync(row, from)
            src, token = choice // (N * K), choice // K % N
            stage_row = src * N + token
            weight = stage_w.load_as(np.float32, choice, "stage w")
            store_plan_row(a, p, (src, token, choice % K, weight), stage_x, stage_sf, stage_row, row_bytes,
                           sf_per_row, "stage")
            if src == a.own_rank % 2**64:  # static_cast<u64>(own_rank): -1 names no source
                a.own_row.store_as(np.int32, choice % (N * K), p, "own_row")


def store_group_end(a, offsets: list[int], num_local: int) -> None:
    """group_end[e] = offsets[e] + counts[e] (block 0: for (e = threadIdx.x; e < num_local; e += blockDim.x);
    unsigned, stored as int)."""
    e_all = np.arange(num_local)
    end = np.array(offsets[:num_local], np.int64) + a.counts.load_as(np.uint32, e_all, "counts")
    a.group_end.store_as(np.int32, e_all, end.astype(np.uint32).view(np.int32), "group_end")


def store_plan_row(a, p: int, fields: tuple, x, sf, row: int, row_bytes: int, sf_per_row: int, what: str) -> None:
    """Plan row ``p``: lane 0 stores its (src, token, k, weight) ``fields``, the warp copies row ``row`` of ``x``
    (warp_copy16) and of the scales ``sf`` (``what``: whose rows, stage or pool)."""
    src, token, k, weight = fields
    a.row_src.store_as(np.int32, p, src, "row_src")
    a.row_token.store_as(np.int32, p, token, "row_token")
    a.row_k.store_as(np.int32, p, k, "row_k")
    a.row_weight.store_as(np.float32, p, weight, "row_weight")
    warp_copy16(a.rows, p * row_bytes, x, row * row_bytes, row_bytes)
    j = np.arange(sf_per_row, dtype=np.int64)  # for (j = lane; j < sf_per_row; j += kWarp): every j once
    a.rows_sf.store_as(np.float32, j * a.sf_stride + p,
                       sf.load_as(np.float32, row * sf_per_row + j, f"{what} sf"), "rows_sf")


def moe_plan_reset(memory, grid, block, shared_bytes, a) -> None:
    """A plan with nothing planned: every counter word 0, every row's source -1, no own choice (grid-stride stores,
    every index once)."""
    a.counters.store_as(np.uint32, np.arange(a.counter_words), 0, "counters")
    a.row_src.store_as(np.int32, np.arange(a.rows), -1, "row_src")
    a.own_row.store_as(np.int32, np.arange(a.own_choices), -1, "own_row")


def kernels(order_seed: int = 0) -> dict:
    """The emulated plan kernels by name, for :class:`tests.helpers.emulation.machine.EmulatedLibrary`."""
    return {"moe_plan_reset": moe_plan_reset, "moe_plan_count": moe_plan_count,
            "moe_plan_scatter": lambda *args: moe_plan_scatter(*args, order_seed=order_seed)}
