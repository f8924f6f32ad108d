"""The decode path's kernels run on the CPU as written (tests/unit/test_moe_decode_emulation.py drives them): the
warp engine of device/include/chunkring/moe/decode_gemm.cuh (decode_gemm.py), moe_decode_l1 / moe_decode_l2 of
device/kernels/moe_decode.cu, and - the semantics the decode kernels replace or feed - moe_swiglu_fp8,
moe_combine_push (DIRECT sources: no ring descriptor, or one without RMA peers) and moe_combine_reduce of
device/kernels/moe_experts.cu, with fp8.cuh's arithmetic.

Each function below mirrors one device function line by line: the same index arithmetic, loop bounds, early exits,
guards and stores, per block of the launch grid and per thread (numpy arrays over threadIdx.x); shared memory
between two __syncthreads is a phase run by every thread before the next. Global memory is
tests/helpers/emulation/machine.py's: every computed offset is checked against the allocation it came from.

Where it cannot be faithful: __expf (the emulation's exp is numpy's fp32 exp), the tensor core's summation order and
internal precision (emulated as an exact sum rounded once), and anything about timing or memory ordering."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.decode_gemm import (
    KBLOCK,
    MTILES,
    PASS_ROWS,
    SCALE_ROWS,
    TILE_ROWS,
    TOKEN_TILES,
    WARPS,
    Ring,
    set_tokens,
    start_weights,
    warp_gemm,
)
from tests.helpers.emulation.machine import (
    WARP,
    EmulatedMemoryError,
    Pointer,
    Threads,
    bf16_bits,
    e4m3_bits,
    header_constant,
    header_enum,
    header_structs,
    read_struct,
    round_bf16,
    shfl_xor,
)

__all__ = ["kernels"]

E4M3_MAX = np.float32(448.0)
RING_FIELDS = header_structs("chunkring/layout/ring_desc.cuh")["RingDesc"]
RING_VERSION = header_constant("chunkring/layout/ring_desc.cuh", "kRingLayoutVersion")
STATUS = header_enum("chunkring/layout/ring_desc.cuh", "StatusWord")


def bf16_values(bits) -> np.ndarray:
    """__bfloat162float of bf16 bit patterns (uint16): fp32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


# -- fp8.cuh ------------------------------------------------------------------------------------------------------
def e4m3_scale(amax):
    scale = (np.asarray(amax, np.float32) / E4M3_MAX).astype(np.float32)
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def clamp_e4m3(y):
    return np.fmin(np.fmax(y, -E4M3_MAX), E4M3_MAX).astype(np.float32)


def silu_mul(gate, up):
    gate, up = np.asarray(gate, np.float32), np.asarray(up, np.float32)
    with np.errstate(over="ignore"):  # exp(-gate) = inf for a very negative gate, as __expf's: silu -> -0
        return (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(np.float32)


# -- moe_decode.cu ------------------------------------------------------------------------------------------------
def rows_of(counts, e: int) -> int:
    return int(counts.load_as(np.uint32, e, "counts"))


def first_row(group_end, e: int, rows: int) -> int:
    return (int(group_end.load_as(np.int32, e, "group_end")) - rows) % 2**64


class Prior:
    """The kernel's view of what the kernel ahead of it writes or reads: ``ready`` after wait_prior_grid. Before
    it, a block may read only its expert's count and the weights (the operands a pre-wait read would touch are
    handed out here, and refuse to be)."""

    def __init__(self, a) -> None:
        self.a, self.ready = a, False

    def wait(self) -> None:
        self.ready = True

    def __getattr__(self, name: str):
        if not self.__dict__["ready"]:
            raise EmulatedMemoryError(f"{name} read before wait_prior_grid")
        return getattr(self.__dict__["a"], name)


def swiglu_quantise(acc, first, rows, chunk, inter, sf_stride, act, act_sf, th: Threads, trace) -> None:
    """swiglu_quantise: SwiGLU of the warp's gate (acc m tile 0) and up (m tile 1) columns, the 128-column absmax
    per token through shared amax_of[kWarps][kPassRows], e4m3 act and its scale for the pass's real rows."""
    lane, warp = th.lane, th.warp
    g, t = lane // 4, lane % 4
    v = np.zeros((th.count, TOKEN_TILES, 4), np.float32)
    amax = np.zeros((th.count, TOKEN_TILES, 2), np.float32)
    for j in range(TOKEN_TILES):
        for c in range(4):
            gate, up = round_bf16(acc[:, 0, j, c]), round_bf16(acc[:, 1, j, c])
            v[:, j, c] = silu_mul(gate, up)
            amax[:, j, c % 2] = np.fmax(amax[:, j, c % 2], np.abs(v[:, j, c]))
    amax_of = np.full((WARPS, PASS_ROWS), np.nan, np.float32)  # shared: this pass's stores only are readable
    stored = np.zeros(amax_of.shape, np.int32)
    for j in range(TOKEN_TILES):
        for h in range(2):
            for offset in (4, 8, 16):
                amax[:, j, h] = np.fmax(amax[:, j, h], shfl_xor(amax[:, j, h], offset))
            who = g == 0
            slot = (warp[who], j * 8 + 2 * t[who] + h)
            if warp.max() >= WARPS:
                raise EmulatedMemoryError("amax_of: a warp past kWarps")
            np.add.at(stored, slot, 1)
            amax_of[slot] = amax[who, j, h]
    if (stored > 1).any():
        raise EmulatedMemoryError("amax_of: a slot stored twice")
    # __syncthreads()
    if not stored.all():
        raise EmulatedMemoryError("amax_of: a slot read before this pass stored it")
    scale = np.zeros((th.count, TOKEN_TILES, 2), np.float32)
    for j in range(TOKEN_TILES):
        for h in range(2):
            m = np.zeros(th.count, np.float32)
            for w in range(WARPS):
                m = np.fmax(m, amax_of[w, j * 8 + 2 * t + h])
            scale[:, j, h] = e4m3_scale(m)
    col = chunk * SCALE_ROWS + warp * TILE_ROWS + g
    for j in range(TOKEN_TILES):
        for c in range(4):
            token = j * 8 + 2 * t + c % 2
            live = token < rows  # the others `continue`
            q = clamp_e4m3((v[live, j, c] / scale[live, j, c % 2]).astype(np.float32))
            at = (first + token[live]) * inter + col[live] + (c // 2) * 8
            act.store(at, e4m3_bits(q)[:, None], "act")
            trace.append((first + token[live], col[live] + (c // 2) * 8, acc[live, 0, j, c], acc[live, 1, j, c]))
    lead = (warp == 0) & (g == 0)
    for j in range(TOKEN_TILES):
        for h in range(2):
            token = j * 8 + 2 * t + h
            live = lead & (token < rows)
            act_sf.store_as(np.float32, chunk * sf_stride + first + token[live], scale[live, j, h], "act_sf")
    # __syncthreads(): amax_of is rewritten by the next pass


def moe_decode_l1(memory, grid, block, shared_bytes, a, trace) -> None:
    """``trace`` (the emulation's, not the kernel's) gets (rows, columns, gate, up) of the fp32 sums the epilogue
    rounds, for every act element it stores."""
    th = Threads(block)
    H, inter = a.hidden, a.inter
    chunks = inter // SCALE_ROWS
    for block_idx in range(grid):
        prior = Prior(a)
        e, chunk = block_idx // chunks, block_idx % chunks
        rows = rows_of(a.counts, e)
        if rows == 0:
            continue  # finish_idle(); return: uniform across the block
        warp, g = th.warp, th.lane // 4
        kblocks, scale_rows = H // KBLOCK, 2 * inter // SCALE_ROWS
        op = SimpleNamespace(w=a.w13, w_sf=a.w13_sf, k_bytes=H, sf_stride=a.sf_stride)
        row0 = chunk * SCALE_ROWS + warp * TILE_ROWS + g
        op.w_row = [(e * 2 * inter + row0) * H, (e * 2 * inter + inter + row0) * H]
        op.w_scale = [np.full(block, (e * scale_rows + chunk) * kblocks),
                      np.full(block, (e * scale_rows + inter // SCALE_ROWS + chunk) * kblocks)]
        ring = Ring(block)  # the warps' rings, one block's dynamic shared memory
        start_weights(ring, op, kblocks, th)
        prior.wait()
        op.x, op.x_sf = prior.rows, prior.rows_sf
        first = first_row(prior.group_end, e, rows)
        for done in range(0, rows, PASS_ROWS):
            if done > 0:
                start_weights(ring, op, kblocks, th)
            here = min(rows - done, PASS_ROWS)
            tiles = set_tokens(op, first + done, here, th)
            acc = warp_gemm(op, ring, kblocks, tiles, th)
            swiglu_quantise(acc, first + done, here, chunk, inter, op.sf_stride, prior.act, prior.act_sf, th, trace)


def moe_decode_l2(memory, grid, block, shared_bytes, a) -> None:
    th = Threads(block)
    H, inter = a.hidden, a.inter
    chunks = H // (MTILES * SCALE_ROWS)
    for block_idx in range(grid):
        prior = Prior(a)
        e, chunk = block_idx // chunks, block_idx % chunks
        rows = rows_of(a.counts, e)
        if rows == 0:
            continue  # finish_idle(); return
        warp, g, t = th.warp, th.lane // 4, th.tid % 4
        kblocks, scale_rows = inter // KBLOCK, H // SCALE_ROWS
        op = SimpleNamespace(w=a.w2, w_sf=a.w2_sf, k_bytes=inter, sf_stride=a.sf_stride, w_row=[None] * MTILES,
                             w_scale=[None] * MTILES)
        col = [None] * MTILES
        for i in range(MTILES):
            blk = chunk * MTILES + i
            col[i] = blk * SCALE_ROWS + warp * TILE_ROWS + g
            op.w_row[i] = (e * H + col[i]) * inter
            op.w_scale[i] = np.full(block, (e * scale_rows + blk) * kblocks)
        ring = Ring(block)
        start_weights(ring, op, kblocks, th)
        prior.wait()
        op.x, op.x_sf = prior.act, prior.act_sf
        first0 = first_row(prior.group_end, e, rows)
        for done in range(0, rows, PASS_ROWS):
            if done > 0:
                start_weights(ring, op, kblocks, th)
            here = min(rows - done, PASS_ROWS)
            first = first0 + done
            tiles = set_tokens(op, first, here, th)
            acc = warp_gemm(op, ring, kblocks, tiles, th)
            for i in range(MTILES):
                for j in range(TOKEN_TILES):
                    for c in range(4):
                        token = j * 8 + 2 * t + c % 2
                        live = token < here
                        at = (first + token[live]) * H + col[i][live] + (c // 2) * 8
                        prior.out.store(at * 2, bf16_bits(acc[live, i, j, c]), "out")


# -- moe_experts.cu -----------------------------------------------------------------------------------------------
def group_offsets(counts, num_local: int, block_m: int, block: int, shared_bytes: int) -> list[int]:
    """group_offsets: offsets[e] (the padded counts' exclusive scan) and offsets[E] in the dynamic shared memory. Its
    shuffle scans need whole warps, at most 32 of them."""
    if block % 32 or block > 1024:
        raise EmulatedMemoryError(f"group_offsets: a block of {block} threads is not whole warps, at most 32")
    if (num_local + 1) * 4 > shared_bytes:
        raise EmulatedMemoryError("group_offsets: the dynamic shared offsets overflow")
    per_thread = (num_local + block - 1) // block
    bounds = [(min(x * per_thread, num_local), min(min(x * per_thread, num_local) + per_thread, num_local))
              for x in range(block)]

    def padded(e):
        c = int(counts.load_as(np.uint32, e, "counts"))
        return (c + block_m - 1) // block_m * block_m

    partial = [sum(padded(e) for e in range(lo, hi)) for lo, hi in bounds]
    partial = [sum(partial[:x]) for x in range(block)] + [sum(partial)]  # each thread's exclusive scan; the total
    offsets = [0] * (num_local + 1)
    offsets[num_local] = partial[block]
    for x, (lo, hi) in enumerate(bounds):
        run = partial[x]
        for e in range(lo, hi):
            offsets[e], run = run, run + padded(e)
    return offsets


def moe_swiglu_fp8(memory, grid, block, shared_bytes, a) -> None:
    """A warp per (row, 128-column block) of the rows in use; the grid-stride loop hands each item to exactly one
    warp and no item depends on another, so the items run here all at once."""
    offsets = group_offsets(a.counts, a.num_local, a.block_m, block, shared_bytes)
    used, inter = offsets[a.num_local], a.inter
    blocks = inter // 128
    item = np.arange(used * blocks, dtype=np.int64)
    row, blk = item // blocks, item % blocks
    keep = a.row_src.load_as(np.int32, row, "row_src") >= 0
    row, blk = row[keep], blk[keep]
    lane = np.arange(WARP)
    col = blk[:, None] * 128 + lane * 4  # [items, lanes]
    g = row[:, None] * 2 * inter + col
    gate = a.gate_up.load(g * 2, 8, "gate").view(np.uint16)
    up = a.gate_up.load((g + inter) * 2, 8, "up").view(np.uint16)
    v = silu_mul(bf16_values(gate), bf16_values(up))  # [items, lanes, 4]
    amax = np.fmax.reduce(np.fmax.reduce(np.abs(v), axis=2), axis=1)  # the lane's 4, then the warp's butterfly
    scale = e4m3_scale(amax)
    q = clamp_e4m3((v / scale[:, None, None]).astype(np.float32))
    a.act.store(row[:, None] * inter + col, e4m3_bits(q), "act")
    a.act_sf.store_as(np.float32, blk * a.sf_stride + row, scale, "act_sf")


def weighted(bits: np.ndarray, w: np.float32) -> np.ndarray:
    """weighted: bf16 element bits times a top-k weight in fp32, rounded to bf16 (bits)."""
    return bf16_bits((bf16_values(bits) * w).astype(np.float32))


def moe_combine_push(memory, grid, block, shared_bytes, a) -> None:
    """DIRECT sources only (desc null, or a ring descriptor whose rma_peers is 0): each real row of another source
    than own_rank times its weight, bf16, to peer_combine[src] + (token K + k) H."""
    if a.desc is not None and read_struct(a.desc, RING_FIELDS, "RingDesc").rma_peers != 0:
        raise NotImplementedError("the RMA path (puts, put_done) is not emulated")
    offsets = group_offsets(a.counts, a.num_local, a.block_m, block, shared_bytes)
    used, H = offsets[a.num_local], a.hidden
    for block_idx in range(grid):
        for row in range(block_idx, used, grid):
            src = int(a.row_src.load_as(np.int32, row, "row_src"))
            if src < 0 or src == a.own_rank:
                continue
            w = np.float32(a.row_weight.load_as(np.float32, row, "row_weight"))
            token = int(a.row_token.load_as(np.int32, row, "row_token")) % 2**64
            at = (token * a.topk + int(a.row_k.load_as(np.int32, row, "row_k"))) * H
            peer, to = memory.at(int(a.peer_combine.load_as(np.uint64, src, "peer_combine")), "peer_combine[src]")
            i = np.arange(0, H, 8)  # thread x takes i = 8x, 8x + 8 blockDim, ...: every i once
            v = a.out.load((row * H + i) * 2, 16, "out row").view(np.uint16)
            peer.store(to + (at + i) * 2, weighted(v, w).reshape(len(i), 16), "combine row")
    # Thread 0 of every block: atomicAdd(pushed, 1) (an atomic: exempt from the one-store-per-launch check).
    a.pushed.raw[:8] = (a.pushed.load_as(np.int64, 0, "pushed") + grid).reshape(1).view(np.uint8)


def moe_combine_reduce(memory, grid, block, shared_bytes, a) -> None:
    """out[t] = the sum over k of choice t K + k's row where routing[t K + k] >= 0, in fp32 in k order, rounded once
    to bf16: own_out's row own_row[t K + k] times weights[t K + k] (as the push weights) where own_row is given and
    names one, else combine row t K + k. The rows of masked choices are never loaded, so an unwritten
    (uninitialised) row there is never read. A ring descriptor (``desc``) whose status holds an error (or does not
    check): ``out`` zeros instead."""
    n, K, H = a.tokens, a.topk, a.hidden
    if a.desc is not None:
        d = read_struct(a.desc, RING_FIELDS, "RingDesc")
        status = Pointer(memory, d.base + d.off_status, "status words")
        described = d.layout_version == RING_VERSION and d.desc_bytes == 8 * len(RING_FIELDS)
        if not described or int(status.load_as(np.uint64, STATUS["kStatusCode"], "status code")) != 0:
            for t in range(n):  # (a descriptor that does not check also records kBadDescriptor: not emulated)
                a.out.store(t * H * 2 + np.arange(0, 2 * H, 2), np.zeros((H, 2), np.uint8), "out row")
            return
    if H % 8:
        raise NotImplementedError("the scalar path (hidden % 8 != 0, or unaligned buffers) is not emulated")
    vectors = np.arange(0, 2 * H, 16)  # the row's 16-byte vectors, eight values each
    for t in range(n):
        acc = np.zeros(H, np.float32)
        for k in range(K):
            choice = t * K + k
            if a.routing.load_as(np.int32, choice, "routing") < 0:
                continue
            p = int(a.own_row.load_as(np.int32, choice, "own_row")) if a.own_row is not None else -1
            if p >= 0:
                row = a.own_out.load(p * H * 2 + vectors, 16, "own row").view(np.uint16).reshape(H)
                w = np.float32(a.weights.load_as(np.float32, choice, "weights"))
                row = weighted(row, w).view(np.uint16).reshape(H)
            else:
                row = a.combine.load(choice * H * 2 + vectors, 16, "combine row").view(np.uint16).reshape(H)
            acc = (acc + bf16_values(row)).astype(np.float32)
        a.out.store(t * H * 2 + vectors, bf16_bits(acc).reshape(H // 8, 16), "out row")


def kernels(trace: list) -> dict:
    """The emulated kernels by name, for :class:`tests.helpers.emulation.machine.EmulatedLibrary`; L1's sums go
    to ``trace``."""
    return {"moe_decode_l1": lambda *args: moe_decode_l1(*args, trace), "moe_decode_l2": moe_decode_l2,
            "moe_swiglu_fp8": moe_swiglu_fp8, "moe_combine_push": moe_combine_push,
            "moe_combine_reduce": moe_combine_reduce}
