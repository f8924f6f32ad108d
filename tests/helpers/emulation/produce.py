"""The MoE layer's producers of device/kernels/moe_produce.cu run on the CPU as written (tests/unit/
test_moe_produce_emulation.py drives them through chunkring.moe._engine.producer): ``moe_router_logits`` on the PTX
ISA's mma.m16n8k16 bf16 fragments, each warp's slice of hidden columns summed step by step in fp32 and the slices added
in order; ``moe_produce_chunk`` per block - begin_chunk, its share of the rows (route_token's K rounds and butterfly
sum, quantize_block or the bf16 copy) stored into the ring slot, last_block_to_arrive on ``arrivals``, the last block's
close_chunk - on tests/helpers/emulation/ring.py's heap and streams, consumed by pull.py's moe_pull.

Two checks the producer adds to the ring emulation's: a slot's bytes count as unwritten from its chunk's first
begin_chunk until a block stores them (a consumer that reads one reads a value the chunk never wrote: the
allocation's uninitialised-read check), and no block stores into a slot whose ready word already holds the chunk's
generation (a write after the publish). A block also yields, as a GPU block may be overtaken, after begin_chunk,
before its arrival and after it, so the seeded order interleaves other blocks and the consumer there.

Not modelled: the tensor core's internal order and precision (each MMA step's 16 products are summed in fp64 - exact
for these tests' data - and added to the accumulator with one rounding to fp32), expf's last ulps (fp64 exp rounded
to fp32), warps inside a block (a block's tasks run in one step), memory ordering, the fences."""

from __future__ import annotations

import functools

import numpy as np

from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation.machine import WARP, EmulatedMemoryError, Pointer, e4m3_bits, shfl_xor
from tests.helpers.emulation.ring import META_WORDS, RingView, StreamLibrary

__all__ = ["ProduceLibrary", "kernels", "mma_m16n8k16_bf16", "rank_order", "router_kernel"]

ROUTER_ROWS, ROUTER_COLS, ROUTER_MAX_SLICES, SCALE_BLOCK, E4M3_MAX = 16, 32, 16, 128, np.float32(448.0)


def _fragment_tables():
    """The PTX ISA's mma.m16n8k16 fragments for bf16 (g = lane / 4, t = lane % 4; half i of a register, the low
    half first): a[r] holds A[g + 8 (r % 2)][2t + 8 (r / 2) + i], b[r] holds B[2t + 8 r + i][g]. Each table is
    checked to cover its matrix exactly once (C's is machine.py's: c[i] is C[g + 8 (i / 2)][2t + i % 2])."""
    lane, reg, half = np.meshgrid(np.arange(WARP), np.arange(4), np.arange(2), indexing="ij")
    g, t = lane // 4, lane % 4
    a = (g + 8 * (reg % 2), 2 * t + 8 * (reg // 2) + half)
    b = (2 * t[:, :2] + 8 * reg[:, :2] + half[:, :2], g[:, :2])
    for (rows, cols), shape in ((a, (16, 16)), (b, (16, 8))):
        cells = sorted(zip(rows.ravel().tolist(), cols.ravel().tolist(), strict=True))
        assert cells == [(r, k) for r in range(shape[0]) for k in range(shape[1])]
    return a, b


A16, B16 = _fragment_tables()


def bf16_values(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 2k] of bf16 pairs -> float64 [..., k]."""
    return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def mma_m16n8k16_bf16(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 of one warp: c fp32 [16, 8], a float64 [32 lanes, 4, 2]
    and b float64 [32, 2, 2] (the fragments' bf16 values); returns d as a matrix."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    A[A16] = a
    B[B16] = b
    return (c.astype(np.float64) + A @ B).astype(np.float32)


# ---------------------------------------------------------------- moe_router_logits
def router_slice(a, r0: int, c0: int, k_lo: int, k_hi: int) -> np.ndarray:
    """One warp's slice [k_lo, k_hi) of a 16 x 32 tile: fp32 [16, 32] (the four N tiles' C side by side). A padding
    row or expert is never loaded (its fragment is 0)."""
    H, lane = a.hidden_size, np.arange(WARP)
    g, t = lane // 4, lane % 4
    rows = np.stack([r0 + g, r0 + g + 8, r0 + g, r0 + g + 8], axis=1)  # a[0..3]'s row; +8 columns for a[2], a[3]
    experts = c0 + 8 * np.arange(4)[:, None] + g  # [j, lane]
    acc = np.zeros((16, ROUTER_COLS), np.float32)
    for k in range(k_lo, k_hi, 16):
        a_cols = k + 2 * t[:, None] + 8 * (np.arange(4) // 2)
        frag_a = load_pairs(a.hidden, rows, a_cols, rows < a.n, H, "router A")
        for j in range(4):
            e = np.broadcast_to(experts[j][:, None], (WARP, 2))
            frag_b = load_pairs(a.router, e, k + 2 * t[:, None] + 8 * np.arange(2), e < a.num_experts, H, "router B")
            acc[:, 8 * j:8 * j + 8] = mma_m16n8k16_bf16(acc[:, 8 * j:8 * j + 8], frag_a, frag_b)
    return acc


def load_pairs(matrix, rows, cols, real, H: int, what: str) -> np.ndarray:
    """bf16_pair: the u32 at [row][col] of a bf16 [*, H] matrix where real, else 0; float64 [..., 2]."""
    out = np.zeros((*rows.shape, 2))
    if real.any():
        out[real] = bf16_values(matrix.load(2 * (rows[real] * H + cols[real]), 4, what))
    return out


def router_block(a, b: int, grid: int, block: int):
    slices = block // WARP
    if slices > ROUTER_MAX_SLICES or block % WARP or a.hidden_size % 16:
        return  # not a launch of ours
    H = a.hidden_size
    slice_len = (H // 16 + slices - 1) // slices * 16
    col_tiles = (a.num_experts + ROUTER_COLS - 1) // ROUTER_COLS
    tiles = (a.n + ROUTER_ROWS - 1) // ROUTER_ROWS * col_tiles
    for tile in range(b, tiles, grid):
        r0, c0 = tile // col_tiles * ROUTER_ROWS, tile % col_tiles * ROUTER_COLS
        partial = [router_slice(a, r0, c0, min(w * slice_len, H), min(min(w * slice_len, H) + slice_len, H))
                   for w in range(slices)]
        total = partial[0]
        for s in range(1, slices):
            total = (total + partial[s]).astype(np.float32)  # the slices in order, fp32 each
        row, col = np.meshgrid(r0 + np.arange(ROUTER_ROWS), c0 + np.arange(ROUTER_COLS), indexing="ij")
        real = (row < a.n) & (col < a.num_experts)
        a.logits.store_as(np.float32, row[real] * a.num_experts + col[real], total[real], "logits")
    yield from ()


# ---------------------------------------------------------------- moe_produce_chunk: arithmetic
def rank_order(logits: np.ndarray, topk: int) -> np.ndarray:
    """route_token's K rounds for one row: each round the best expert strictly after the previous pick in the top-k
    order (larger key first, rank_key's keys; equal keys: the lower expert first). int [K]."""
    keys = rank_keys(logits)
    picks: list[int] = []
    for _ in range(topk):
        best = -1
        for e in range(len(logits)):
            if picks and not before(keys, picks[-1], e):
                continue
            if best < 0 or before(keys, e, best):
                best = e
        picks.append(best)
    return np.array(picks)


def rank_keys(logits: np.ndarray) -> np.ndarray:
    """moe_produce.cu rank_key per logit: uint32, a larger float a larger key, -0 == +0, NaN above +inf."""
    logits = np.asarray(logits, np.float32)
    bits = np.where(logits == 0, np.float32(0), logits).astype(np.float32).view(np.uint32)
    keys = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(logits), np.uint32(0xFFFFFFFF), keys)


def before(keys: np.ndarray, a: int, b: int) -> bool:
    return bool(keys[a] > keys[b] or (keys[a] == keys[b] and a < b))


def route_token(logits: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """idx int32 [K], weights fp32 [K]: lane k keeps pick k's logit, e = expf(l - l_top), summed by the butterfly."""
    idx = rank_order(logits, topk)
    lane = np.arange(WARP)
    mine = np.zeros(WARP, np.float32)
    mine[:topk] = logits[idx]
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(lane < topk, np.exp((mine - mine[0]).astype(np.float32).astype(np.float64)), 0).astype(np.float32)
        total = e
        for offset in (16, 8, 4, 2, 1):
            total = (total + shfl_xor(total, offset)).astype(np.float32)
        return idx.astype(np.int32), (e / total).astype(np.float32)[:topk]


def quantize_block(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """128 fp32 values -> e4m3 bytes [128] and the scale: NaN wins the absmax; e4m3_scale; clamp unless NaN."""
    amax = np.float32(np.nan) if np.isnan(x).any() else np.abs(x).max()
    scale = np.float32(amax / E4M3_MAX)
    scale = scale if scale > 0 else np.float32(1.0)
    with np.errstate(invalid="ignore"):
        y = (x / scale).astype(np.float32)
    return e4m3_bits(np.where(np.isnan(y), y, np.clip(y, -E4M3_MAX, E4M3_MAX))), scale


# ---------------------------------------------------------------- moe_produce_chunk: the protocol
def begin_chunk(ring: RingView, epoch: int, seq: int, begun: set):
    """protocol/ring.cuh begin_chunk, as pull.py's, but every block stores the same consumed word (benignly:
    the same value) - so an ordered store; the first block past it marks the slot's bytes unwritten."""
    d, slot = ring.d, seq % ring.d.num_slots
    if not (yield from pull_emu.begin_chunk(ring, epoch, seq, ordered=True)):
        return False
    if (d.base, seq) not in begun:
        begun.add((d.base, seq))
        for name, size in (("x", d.x_row_bytes), ("x_sf", 4 * d.x_sf_row_floats), ("topk_idx", 4 * d.topk),
                           ("topk_weights", 4 * d.topk), ("meta", 0)):
            nbytes = META_WORDS * 8 if name == "meta" else d.tokens_per_slot * size
            alloc, at = Pointer(ring.memory, ring.part(name, slot), name).target("stale slot")
            alloc.valid[at:at + nbytes] = False  # the previous lap's bytes: nothing this chunk wrote
    return True


def check_unpublished(ring: RingView, epoch: int, seq: int) -> None:
    """A slot is written only before its chunk's publish: no destination's ready word holds its generation yet."""
    word = ring.ready_word("route", ring.d.my_pe, seq % ring.d.num_slots)
    for dest in range(ring.d.world_size):
        if ring.load(ring.remote(word, dest), "ready") == ring.gen(epoch, seq):
            raise EmulatedMemoryError(f"PE {ring.d.my_pe} block {ring.block} writes slot {seq % ring.d.num_slots} "
                                      f"of chunk {seq} after its publish")


def produce_rows(ring: RingView, a, seq: int, n: int, part: int, parts: int) -> None:
    """This block's rows [lo, hi): routing, then each row's 128-column blocks (FP8 or the bf16 copy)."""
    d, slot, E = ring.d, seq % ring.d.num_slots, a.num_experts
    pull_emu.check_free(ring, ring.epoch(), seq)
    check_unpublished(ring, ring.epoch(), seq)
    lo, hi = n * part // parts, n * (part + 1) // parts
    K, H, fp8 = d.topk, d.hidden, d.payload_format == 0
    idx_at, w_at = ring.part("topk_idx", slot), ring.part("topk_weights", slot)
    for row in range(lo, hi):
        logits = a.logits.load_as(np.float32, row * E + np.arange(E), "logits")
        idx, w = route_token(logits, K)
        Pointer(ring.memory, idx_at, "slot topk_idx").store_as(np.int32, row * K + np.arange(K), idx, "topk_idx")
        Pointer(ring.memory, w_at, "slot topk_weights").store_as(np.float32, row * K + np.arange(K), w, "weights")
    x_at, sf_at = ring.part("x", slot), ring.part("x_sf", slot)
    for row in range(lo, hi):
        for block in range(H // SCALE_BLOCK):
            first = row * H + block * SCALE_BLOCK  # bf16 element; each lane loads 4 (8 bytes)
            raw = a.hidden.load(2 * first + 8 * np.arange(WARP), 8, "hidden")
            out = Pointer(ring.memory, x_at + row * d.x_row_bytes, "slot x")
            if not fp8:
                out.store(block * 256 + 8 * np.arange(WARP), raw, "slot x (bf16)")
                continue
            q, scale = quantize_block(bf16_values(raw).reshape(-1).astype(np.float32))
            out.store(block * SCALE_BLOCK + 4 * np.arange(WARP), q.reshape(WARP, 4), "slot x (fp8)")
            Pointer(ring.memory, sf_at, "slot x_sf").store_as(np.float32, row * d.x_sf_row_floats + block, scale,
                                                              "x_sf")


def last_block_to_arrive(ring: RingView, count, blocks: int) -> bool:
    if int(count.atomic_add_as(np.uint32, 0, 1, "arrivals")) != blocks - 1:
        return False
    count.cas_as(np.uint32, 0, blocks, 0, "arrivals")  # *count = 0: a store after the last atomic
    return True


def moe_produce_chunk(ring: RingView, a, part: int, parts: int, *, begun: set, rows_first: bool = True):
    """One block. ``rows_first=False`` is Mutant::kArriveBeforeRows: arrive (maybe publish), then store the rows."""
    if not ring.rank.check_descriptor() or ring.has_error():
        return
    e = pull_emu.chunk_extent(ring, a, part == 0)
    if not e.publish:
        return
    epoch, seq = ring.epoch(), pull_emu.next_seq(ring)
    if not (yield from begin_chunk(ring, epoch, seq, begun)):
        return
    yield from overtaken(ring, "after begin_chunk")
    if rows_first:
        produce_rows(ring, a, seq, e.n, part, parts)
        yield from overtaken(ring, "before its arrival")
    if a.arrivals is None or last_block_to_arrive(ring, a.arrivals, parts):
        pull_emu.close_chunk(ring, epoch, seq, e, a.token_base)
    if not rows_first:
        yield from overtaken(ring, "after its arrival")
        produce_rows(ring, a, seq, e.n, part, parts)


def overtaken(ring: RingView, where: str):
    """A point where other blocks may run (progress: the block goes on when resumed)."""
    ring.streams.progress += 1
    yield f"PE {ring.d.my_pe} block {ring.block} {where}"


def kernels(heap, streams, *, rows_first: bool = True) -> dict:
    """pull.py's kernels (moe_pull among them) and the producers, for a :class:`ProduceLibrary`."""
    produce = functools.partial(moe_produce_chunk, begun=set(), rows_first=rows_first)
    table = pull_emu.kernels(heap, streams, {"moe_produce_chunk": produce})
    table["moe_router_logits"] = lambda memory, grid, block, a: [router_block(a, b, grid, block) for b in range(grid)]
    return table


class ProduceLibrary(StreamLibrary):
    """A StreamLibrary of moe_produce.cu and moe_stream.cu whose launches given a stream (the producers', on the
    stream the test hands enqueue_produce and torch.cuda.current_stream) run in that stream's order."""

    def __init__(self, memory, kernels: dict, streams, initialised) -> None:
        super().__init__(memory, kernels, streams, sources=("moe_produce.cu", "moe_stream.cu"))
        self.initialised = initialised

    def launch(self, name, /, *, grid=1, block, stream=None, shared_bytes=0, pdl=False, **args) -> None:
        if stream is None:
            super().launch(name, grid=grid, block=block, shared_bytes=shared_bytes, **args)
            return
        values = self.arguments(name, args)
        self.launches.append((name, grid, block, args))
        self.streams.enqueue(stream, self.kernels[name](self.memory, int(grid), int(block), values))


def router_kernel(memory, grid: int, block: int, shared_bytes: int, a) -> None:
    """moe_router_logits for a plain EmulatedLibrary (launches run at once): every block in turn."""
    for b in range(grid):
        for _ in router_block(a, b, grid, block):
            pass
