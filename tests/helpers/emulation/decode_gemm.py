"""The decode path's warp engine, device/include/chunkring/moe/decode_gemm.cuh, run on the CPU as written (decode.py's
moe_decode_l1 / moe_decode_l2 drive it): per warp, numpy arrays over its threads. The weight ring in shared memory
is each thread's own slots, with its copy groups: a read of a slot whose group has not landed or that holds another
k block is an error, so the pipeline's indexing is checked; its timing and memory ordering are not."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.machine import EmulatedMemoryError, Threads, fmaf, mma_m16n8k32_e4m3

__all__ = ["KBLOCK", "MTILES", "NULL", "PASS_ROWS", "SCALE_ROWS", "STAGES", "TILE_ROWS", "TILE_TOKENS", "TOKEN_TILES",
           "WARPS", "Ring", "copy_weights", "set_tokens", "start_weights", "warp_gemm"]

# decode_gemm.cuh's constants.
KBLOCK, KSTEPS, TILE_ROWS, TILE_TOKENS, MTILES, TOKEN_TILES, WARPS, STAGES = 128, 4, 16, 8, 2, 4, 8, 6
PASS_ROWS, SCALE_ROWS = TOKEN_TILES * TILE_TOKENS, WARPS * TILE_ROWS
NULL = -1  # a null pointer among byte or element offsets


class Ring:
    """A warp's ring of STAGES k blocks of weight fragments in shared memory, per thread (each lane reads back only
    what it copied): the copies of each committed group, and which k block each slot holds. A read of a slot whose
    group is still in flight, or that holds another k block, is an error: the pipeline's indexing is checked here."""

    def __init__(self, threads: int) -> None:
        self.slots = np.zeros((threads, STAGES, MTILES, 2, 2, 16), np.uint8)
        self.holds = [None] * STAGES  # the k block a slot's copies bring
        self.groups: list[list[int]] = []  # per committed group, the k blocks of its copies
        self.open: list[int] = []  # copies issued since the last commit
        self.landed: set[int] = set()

    def commit(self) -> None:
        self.groups.append(self.open)
        self.open = []

    def wait(self, pending: int) -> None:
        """cp_async_wait<pending>: every group but the newest ``pending`` has landed."""
        for group in self.groups[:max(len(self.groups) - pending, 0)]:
            self.landed.update(group)

    def read(self, kb: int) -> np.ndarray:
        slot = kb % STAGES
        if self.holds[slot] != kb or kb not in self.landed:
            raise EmulatedMemoryError(f"weight ring: k block {kb} read from slot {slot} holding "
                                      f"{self.holds[slot]} (landed: {kb in self.landed})")
        return self.slots[:, slot]


def copy_weights(ring: Ring, op, kb: int, t: np.ndarray) -> None:
    """copy_weights: k block kb of the warp's weight fragments into slot kb % kStages (cp.async, no commit)."""
    lo = kb * KBLOCK + 16 * t
    hi = lo + 64
    slot = kb % STAGES
    for i in range(MTILES):
        for h in range(2):
            row = op.w_row[i] + h * 8 * op.k_bytes
            ring.slots[:, slot, i, h, 0] = op.w.load(row + lo, 16, "weight lo")
            ring.slots[:, slot, i, h, 1] = op.w.load(row + hi, 16, "weight hi")
    ring.holds[slot] = kb
    ring.landed.discard(kb)
    ring.open.append(kb)


def load_tokens(op, kb: int, t: np.ndarray, tiles: int) -> SimpleNamespace:
    """load_tokens: one k block of the warp's token operands and both scales (null token rows and scales read as
    zeros); token tiles from ``tiles`` on are not loaded (None: mma_block never reads them)."""
    lo = kb * KBLOCK + 16 * t
    hi = lo + 64
    tk = SimpleNamespace(x=[None] * TOKEN_TILES, x_scale=[[None, None] for _ in range(TOKEN_TILES)],
                         w_scale=[op.w_sf.load_as(np.float32, op.w_scale[i] + kb, "weight scale")
                                  for i in range(MTILES)])
    for j in range(tiles):
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


def mma_block(slot: np.ndarray, tk, tiles: int, acc: np.ndarray) -> None:
    """mma_block: the slot's weight fragments, the k block's four MMA steps into a fresh fragment, then
    acc += sum * w_scale * x_scale."""
    w = [[[slot[:, i, h, part] for part in range(2)] for h in range(2)] for i in range(MTILES)]
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
        for j in range(tiles):  # the others' sums are zero and their outputs never written
            for c in range(4):  # c even: token 2t, odd: token 2t + 1
                scale = (tk.w_scale[i] * tk.x_scale[j][c % 2]).astype(np.float32)
                acc[:, i, j, c] = fmaf(part[:, i, j, c], scale, acc[:, i, j, c])


def start_weights(ring: Ring, op, kblocks: int, th: Threads) -> None:
    """start_weights: a pass's first kStages k blocks of weight copies, one committed group each (empty past
    kblocks). Reads only the weights: a kernel may call it before it waits for the kernel ahead."""
    t = th.tid % 4
    for kb in range(STAGES):
        if kb < kblocks:
            copy_weights(ring, op, kb, t)
        ring.commit()


def gemm_step(op, ring: Ring, kb: int, kblocks: int, tk, tiles: int, t: np.ndarray, acc: np.ndarray) -> None:
    """gemm_step: wait until block kb's group landed, its MMAs, then its slot's refill with kb + STAGES."""
    ring.wait(STAGES - 1)
    mma_block(ring.read(kb), tk, tiles, acc)
    if kb + STAGES < kblocks:
        copy_weights(ring, op, kb + STAGES, t)
    ring.commit()


def warp_gemm(op, ring: Ring, kblocks: int, tiles: int, th: Threads) -> np.ndarray:
    """warp_gemm: acc [threads, m tile, token tile, 4] over kblocks k blocks, the weights through the warp's ring
    (start_weights' kStages copy groups committed ahead; block kb read after waiting until kStages - 1 remain), the
    tokens in two sets, even and odd blocks, each loaded once its previous block's MMAs read it."""
    t = th.tid % 4
    acc = np.zeros((th.count, MTILES, TOKEN_TILES, 4), np.float32)
    even = load_tokens(op, 0, t, tiles)
    odd = load_tokens(op, 1, t, tiles) if kblocks > 1 else None
    for kb in range(0, kblocks, 2):
        gemm_step(op, ring, kb, kblocks, even, tiles, t, acc)
        if kb + 2 < kblocks:
            even = load_tokens(op, kb + 2, t, tiles)
        if kb + 1 < kblocks:
            gemm_step(op, ring, kb + 1, kblocks, odd, tiles, t, acc)
            if kb + 3 < kblocks:
                odd = load_tokens(op, kb + 3, t, tiles)
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
