"""The decode path's warp engine, device/include/chunkring/moe/decode_gemm.cuh, run on the CPU as written (decode.py's
moe_decode_l1 / moe_decode_l2 drive it): per block, numpy arrays over its threads. The warps' weight rings in shared
memory hold what each lane's bulk copy brought, with a barrier per stage: a wait, a read or a refill out of turn is an
error, so the pipeline's indexing and phases are checked; its timing and memory ordering are not."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.machine import WARP, EmulatedMemoryError, Threads, fmaf, mma_m16n8k32_e4m3

__all__ = ["KBLOCK", "MTILES", "NULL", "PASS_ROWS", "SCALE_ROWS", "STAGES", "TILE_ROWS", "TILE_TOKENS", "TOKEN_TILES",
           "WARPS", "Ring", "copy_weights", "set_tokens", "start_weights", "warp_gemm"]

# decode_gemm.cuh's constants.
KBLOCK, KSTEPS, TILE_ROWS, TILE_TOKENS, MTILES, TOKEN_TILES, WARPS, STAGES = 128, 4, 16, 8, 2, 4, 8, 6
PASS_ROWS, SCALE_ROWS, STAGE_ROWS = TOKEN_TILES * TILE_TOKENS, WARPS * TILE_ROWS, MTILES * TILE_ROWS
NULL = -1  # a null pointer among byte or element offsets


class Ring:
    """The warps' rings (warp_ring): per warp STAGES stages of STAGE_ROWS row segments of KBLOCK bytes, row r copied
    by lane r, and per stage a barrier, here its count of completed phases (a stage's copies land at once). Checked:
    a wait for block n finds its stage's phase n // STAGES complete and no later one (a parity wait could not tell
    them apart); a read finds block n in its stage; a refill finds the stage's block read by then."""

    def __init__(self, threads: int) -> None:
        warps = threads // WARP
        self.stages = np.zeros((warps, STAGES, STAGE_ROWS, KBLOCK), np.uint8)
        self.holds = np.full((warps, STAGES), -1)  # the block number a stage holds
        self.read = np.ones((warps, STAGES), bool)  # whether that block was read (a __syncwarp after its reads)
        self.phases = np.zeros((warps, STAGES), np.int64)  # completed phases of each stage's barrier
        self.base = 0  # blocks of the earlier passes (uniform across the block's warps)

    def wait(self, n: int) -> None:
        """gemm_step's barrier wait for block n: its stage's phase n // STAGES (parity n // STAGES % 2)."""
        stage = n % STAGES
        if not (self.phases[:, stage] == n // STAGES + 1).all():
            raise EmulatedMemoryError(f"weight ring: block {n} waited for in stage {stage} after "
                                      f"{self.phases[:, stage].tolist()} completed phases (expected {n // STAGES + 1})")

    def stage(self, n: int, th: Threads) -> np.ndarray:
        """Each thread's view of block n's stage: [threads, STAGE_ROWS, KBLOCK]."""
        stage = n % STAGES
        if not (self.holds[:, stage] == n).all():
            raise EmulatedMemoryError(f"weight ring: block {n} read from stage {stage} holding "
                                      f"{self.holds[:, stage].tolist()}")
        return self.stages[th.warp, stage]


def copy_weights(ring: Ring, op, kb: int, th: Threads) -> None:
    """copy_weights: the pass's k block kb into its stage, lane r copying row r's segment; lane 0's arrival and the
    copied bytes complete the stage barrier's phase."""
    n = ring.base + kb
    stage = n % STAGES
    if not ring.read[:, stage].all():
        raise EmulatedMemoryError(f"weight ring: stage {stage} refilled with block {n} before block "
                                  f"{ring.holds[0, stage]} was read")
    segments = op.w.load(op.w_segment + kb * KBLOCK, KBLOCK, "weight segment", align=16)  # a bulk copy's alignment
    ring.stages[th.warp, stage, th.lane] = segments
    ring.holds[:, stage] = n
    ring.read[:, stage] = False
    ring.phases[:, stage] += 1


def load_tokens(op, kb: int, t: np.ndarray) -> SimpleNamespace:
    """load_tokens: one k block of the warp's token operands and both scales (null token rows and scales read as
    zeros)."""
    lo = kb * KBLOCK + 16 * t
    hi = lo + 64
    tk = SimpleNamespace(x=[None] * TOKEN_TILES, x_scale=[[None, None] for _ in range(TOKEN_TILES)],
                         w_scale=[op.w_sf.load_as(np.float32, op.w_scale[i] + kb, "weight scale")
                                  for i in range(MTILES)])
    for j in range(TOKEN_TILES):
        x, live = op.x_row[j], op.x_row[j] != NULL
        parts = []
        for start in (lo, hi):
            part = np.zeros((t.size, 16), np.uint8)
            part[live] = op.x.load(x[live] + start[live], 16, "token row")
            parts.append(part)
        tk.x[j] = parts
        for c in range(2):
            sf, live = op.x_scale[j][c], op.x_scale[j][c] != NULL
            tk.x_scale[j][c] = np.zeros(t.size, np.float32)
            tk.x_scale[j][c][live] = op.x_sf.load_as(np.float32, sf[live] + kb * op.sf_stride, "token scale")
    return tk


def word(v: np.ndarray, i: int) -> np.ndarray:
    return v[:, 4 * i:4 * i + 4]  # register word i of a uint4: bytes 4i..4i+3, the lowest address in the low byte


def mma_block(stage: np.ndarray, tk, tiles: int, th: Threads, acc: np.ndarray) -> None:
    """mma_block: the stage's weight fragments (lane g, t: rows i * 16 + g and + 8, bytes [16t, 16t + 16) and
    64 further), the k block's four MMA steps into a fresh fragment, then acc += sum * w_scale * x_scale."""
    g, t = th.lane // 4, th.lane % 4
    threads = np.arange(th.count)

    def fragment(i: int, h: int, part: int) -> np.ndarray:
        start = part * 64 + 16 * t
        return np.stack([stage[threads, i * TILE_ROWS + h * 8 + g, start + b] for b in range(16)], axis=1)

    w = [[[fragment(i, h, part) for part in range(2)] for h in range(2)] for i in range(MTILES)]
    part = np.zeros_like(acc)
    for s in range(KSTEPS):
        at, p = (s % 2) * 2, s // 2
        a = [np.stack([word(w[i][0][p], at), word(w[i][1][p], at), word(w[i][0][p], at + 1),
                       word(w[i][1][p], at + 1)], axis=1) for i in range(MTILES)]
        for j in range(TOKEN_TILES):
            if j >= tiles:
                continue
            b = np.stack([word(tk.x[j][p], at), word(tk.x[j][p], at + 1)], axis=1)
            for i in range(MTILES):
                part[:, i, j] = mma_m16n8k32_e4m3(part[:, i, j], a[i], b)
    for i in range(MTILES):
        for j in range(TOKEN_TILES):
            for c in range(4):  # c even: token 2t, odd: token 2t + 1
                scale = (tk.w_scale[i] * tk.x_scale[j][c % 2]).astype(np.float32)
                acc[:, i, j, c] = fmaf(part[:, i, j, c], scale, acc[:, i, j, c])


def start_weights(ring: Ring, op, kblocks: int, th: Threads) -> None:
    """start_weights: a pass's first STAGES k blocks (fewer if it has fewer). Reads only the weights: a kernel may
    call it before it waits for the kernel ahead."""
    for kb in range(min(STAGES, kblocks)):
        copy_weights(ring, op, kb, th)


def gemm_step(ring: Ring, op, kb: int, kblocks: int, tk, tiles: int, th: Threads, acc: np.ndarray) -> None:
    """gemm_step: wait for block kb's stage, its MMAs, the stage read (__syncwarp), its refill with kb + STAGES."""
    n = ring.base + kb
    ring.wait(n)
    mma_block(ring.stage(n, th), tk, tiles, th, acc)
    ring.read[:, n % STAGES] = True
    if kb + STAGES < kblocks:
        copy_weights(ring, op, kb + STAGES, th)


def warp_gemm(op, ring: Ring, kblocks: int, tiles: int, th: Threads) -> np.ndarray:
    """warp_gemm: acc [threads, m tile, token tile, 4] over kblocks k blocks, the weights through the warps' rings
    (start_weights first), the tokens in two sets, even and odd blocks, each loaded once its previous block's MMAs
    read it; the ring moves on to the next pass."""
    t = th.tid % 4
    acc = np.zeros((th.count, MTILES, TOKEN_TILES, 4), np.float32)
    even = load_tokens(op, 0, t)
    odd = load_tokens(op, 1, t) if kblocks > 1 else None
    for kb in range(0, kblocks, 2):
        gemm_step(ring, op, kb, kblocks, even, tiles, th, acc)
        if kb + 2 < kblocks:
            even = load_tokens(op, kb + 2, t)
        if kb + 1 < kblocks:
            gemm_step(ring, op, kb + 1, kblocks, odd, tiles, th, acc)
            if kb + 3 < kblocks:
                odd = load_tokens(op, kb + 3, t)
    ring.base += kblocks
    return acc


def set_tokens(op, first: int, rows: int, th: Threads) -> int:
    """set_tokens: the pass's token rows and scales (null past ``rows``); returns the token tiles in use."""
    g, t = th.lane // 4, th.tid % 4
    op.x_row, op.x_scale = [None] * TOKEN_TILES, [[None, None] for _ in range(TOKEN_TILES)]
    for j in range(TOKEN_TILES):
        lo = j * TILE_TOKENS
        here = min(rows - lo, TILE_TOKENS) if rows > lo else 0
        p = first + lo
        op.x_row[j] = np.where(g < here, (p + g) * op.k_bytes, NULL)
        for c in range(2):
            op.x_scale[j][c] = np.where(2 * t + c < here, p + 2 * t + c, NULL)
    return (rows + TILE_TOKENS - 1) // TILE_TOKENS
