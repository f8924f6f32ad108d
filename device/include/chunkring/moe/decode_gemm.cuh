// The decode path's warp engine (device/kernels/moe_decode.cu; runtime/chunkring/moe/_engine/decode.py drives it):
// an FP8 block-scaled GEMM for few rows per expert, "swap AB" - the expert's weight rows on the MMA's wide
// side (A: 16 rows per m16n8k32) and the tokens on its narrow side (B: 8 per MMA) - so that one token
// costs one MMA per 512 weight bytes instead of a 64- or 128-row tile of padding.
//
// Each warp owns kMTiles m tiles (16 weight rows each, all in one 128-row scale block per tile) and streams
// their rows over the whole k range once per pass of up to kPassRows tokens. The weights go through a ring of
// kStages k blocks (128 k each) in the warp's part of the block's shared memory, filled by cp.async: kStages - 1
// blocks of copies are in flight while the MMAs consume one, without holding registers (a register pipeline
// spills past 3 stages; at 3 stages, 64 KB in flight per SM read the weights at 2.6 TB/s on the H200). The
// token operands and scales, small and re-read by every warp, are plain loads a whole k block ahead of their
// use, in two register sets that alternate. Weights are read as the checkpoint stores them ([N, K] row-major,
// e4m3): no transformed copy.
//
// The k order. Only the pairing of each k between A and B enters the sum, so both operands take the same
// permutation of each 128-wide k block, chosen so that every fragment comes from 16-byte loads: lane
// t = lane % 4 loads bytes [16t, 16t + 16) ("lo") and [64 + 16t, 64 + 16t + 16) ("hi") of a row's k block
// - for its two weight rows (g and g + 8, g = lane / 4) and for its token (g) - and MMA step s of the block
// takes register words (s % 2) * 2 and (s % 2) * 2 + 1 of part s / 2 (fragment_k below). One load
// instruction of a warp then covers 64 contiguous bytes of 8 rows: whole 32-byte sectors.
//
// Scales, per k block: the block's four MMAs accumulate into a fresh fp32 fragment, which is added to the
// running fp32 total times (weight scale of the 128x128 block) x (the token's 1x128 scale) - DeepGEMM's
// promotion, which keeps the tensor core's FP8 accumulation within one block.
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/ptx/load.cuh"
#include "chunkring/ptx/mma.cuh"

namespace chunkring::moe::decode {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

constexpr u32 kWarp = 32;
constexpr u32 kKBlock = 128;                // k per scale: the weights' 128x128 blocks, the rows' 1x128
constexpr u32 kKSteps = kKBlock / 32;       // MMAs (k = 32 each) per k block
constexpr u32 kTileRows = 16;               // weight rows per MMA (m)
constexpr u32 kTileTokens = 8;              // tokens per MMA (n)
constexpr u32 kMTiles = 2;                  // m tiles per warp
constexpr u32 kTokenTiles = 4;              // token tiles per pass
constexpr u32 kPassRows = kTokenTiles * kTileTokens;  // an expert's rows per pass over its weights
constexpr u32 kWarps = 8;                   // per block
constexpr u32 kThreads = kWarps * kWarp;
constexpr u32 kScaleRows = kWarps * kTileRows;  // 128: m tile i of every warp lies in one scale block
constexpr u32 kStages = 6;                  // k blocks of weight copies per warp: the one in use, the rest in flight
// One k block of a warp's weight fragments in its ring: [m tile][row g, g + 8][lo, hi][lane], 16 bytes each.
// Lanes innermost: a quarter-warp's 16-byte accesses cover 128 contiguous bytes, free of bank conflicts.
constexpr u32 kStageVectors = kMTiles * 2 * 2 * kWarp;
// The block's dynamic shared memory (the launch's shared_bytes; decode.py's DECODE_SHARED_BYTES).
constexpr u32 kSharedBytes = kWarps * kStages * kStageVectors * 16;
static_assert(kScaleRows == kKBlock, "a block's m tile i spans exactly one 128-row weight scale block");
static_assert(kSharedBytes <= 227 * 1024 - 1024, "the ring and the epilogue's static shared memory fit one SM");

// The k (0..127) of a block that a fragment byte holds: MMA step `step` (0..3), lane t = lane % 4, register
// half `half` (0: a[0], a[1], b[0]; 1: a[2], a[3], b[1]), byte `byte` (0..3) of that register word.
// runtime/chunkring/moe/_engine/decode.py mirrors it (fragment_k), tested there.
constexpr __host__ __device__ u32 fragment_k(u32 step, u32 t, u32 half, u32 byte) {
    return (step / 2) * 64 + t * 16 + (step % 2) * 8 + half * 4 + byte;
}

// fragment_k visits every k of the block exactly once: the sum over the block is the whole dot product.
constexpr bool fragment_k_is_a_bijection() {
    bool seen[kKBlock] = {};
    for (u32 step = 0; step < kKSteps; ++step)
        for (u32 t = 0; t < 4; ++t)
            for (u32 half = 0; half < 2; ++half)
                for (u32 byte = 0; byte < 4; ++byte) {
                    const u32 k = fragment_k(step, t, half, byte);
                    if (k >= kKBlock || seen[k]) return false;
                    seen[k] = true;
                }
    return true;
}
static_assert(fragment_k_is_a_bijection(), "the fragment k order must be a permutation of the k block");
static_assert(fragment_k(0, 0, 0, 0) == 0 && fragment_k(1, 0, 0, 0) == 8 && fragment_k(2, 0, 0, 0) == 64 &&
                  fragment_k(0, 3, 1, 3) == 55 && fragment_k(3, 3, 1, 3) == 127,
              "lo part = bytes [16t, 16t + 16) for steps 0-1, hi part = [64 + 16t, 64 + 16t + 16) for steps 2-3");

// What one warp reads, at k = 0; a null token pointer is a token past the pass's rows (read as zeros).
struct WarpOperands {
    const unsigned char* w_row[kMTiles];          // row g of each m tile; row g + 8 lies 8 * k_bytes further
    const float* w_scale[kMTiles];                // each m tile's scale row: k block j at [j]
    const unsigned char* x_row[kTokenTiles];      // token g of each token tile: its FP8 row
    const float* x_scale[kTokenTiles][2];         // tokens 2t, 2t + 1 of each token tile: k block j at j * sf_stride
    u64 k_bytes;                                  // K: bytes per weight row and per token row
    u64 sf_stride;
};

// One k block of a warp's token operands and scales, in registers.
struct Tokens {
    uint4 x[kTokenTiles][2];    // [token tile][lo, hi] of token g
    float x_scale[kTokenTiles][2];
    float w_scale[kMTiles];
};

__device__ __forceinline__ u32 word(const uint4& v, u32 i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Vector v (0..kStageVectors) of a lane's fragments in a ring slot: m tile i, row half h, part (lo, hi).
__device__ __forceinline__ u32 ring_vector(u32 i, u32 h, u32 part, u32 lane) {
    return ((i * 2 + h) * 2 + part) * kWarp + lane;
}

// Copies k block kb of the warp's weight fragments into its ring slot kb % kStages (no commit).
__device__ __forceinline__ void copy_weights(uint4* ring, const WarpOperands& op, u32 kb, u32 lane) {
    const u64 lo = static_cast<u64>(kb) * kKBlock + 16 * (lane % 4), hi = lo + 64;
    uint4* slot = ring + (kb % kStages) * kStageVectors;
#pragma unroll
    for (u32 i = 0; i < kMTiles; ++i)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const unsigned char* row = op.w_row[i] + h * 8 * op.k_bytes;
            ptx::cp_async_16(slot + ring_vector(i, h, 0, lane), row + lo);
            ptx::cp_async_16(slot + ring_vector(i, h, 1, lane), row + hi);
        }
}

// Token tiles from `tiles` on are not loaded (uniform across the warp): mma_block never reads them.
__device__ __forceinline__ void load_tokens(Tokens& tk, const WarpOperands& op, u32 kb, u32 t, u32 tiles) {
    const u64 lo = static_cast<u64>(kb) * kKBlock + 16 * t, hi = lo + 64;
#pragma unroll
    for (u32 i = 0; i < kMTiles; ++i) tk.w_scale[i] = __ldg(op.w_scale[i] + kb);
#pragma unroll
    for (u32 j = 0; j < kTokenTiles; ++j) {
        if (j >= tiles) continue;
        // The token rows are re-read by every warp of the block (and every block of the expert): cached loads.
        const unsigned char* x = op.x_row[j];
        tk.x[j][0] = x != nullptr ? __ldg(reinterpret_cast<const uint4*>(x + lo)) : make_uint4(0, 0, 0, 0);
        tk.x[j][1] = x != nullptr ? __ldg(reinterpret_cast<const uint4*>(x + hi)) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (u32 c = 0; c < 2; ++c) {
            const float* sf = op.x_scale[j][c];
            tk.x_scale[j][c] = sf != nullptr ? __ldg(sf + static_cast<u64>(kb) * op.sf_stride) : 0.0f;
        }
    }
}

// acc[i][j] += (the k block's MMAs of m tile i and token tile j) * w_scale[i] * x_scale of the column's
// token, the weights from ring slot `slot`; token tiles from `tiles` on are skipped (uniform across the warp).
__device__ __forceinline__ void mma_block(const uint4* slot, const Tokens& tk, u32 tiles, u32 lane,
                                          float (&acc)[kMTiles][kTokenTiles][4]) {
    uint4 w[kMTiles][2][2];  // [m tile][row g, row g + 8][lo, hi]
#pragma unroll
    for (u32 i = 0; i < kMTiles; ++i)
#pragma unroll
        for (u32 h = 0; h < 2; ++h)
#pragma unroll
            for (u32 part = 0; part < 2; ++part) w[i][h][part] = slot[ring_vector(i, h, part, lane)];
    float sum[kMTiles][kTokenTiles][4] = {};
#pragma unroll
    for (u32 s = 0; s < kKSteps; ++s) {
        const u32 at = (s % 2) * 2, p = s / 2;
        u32 a[kMTiles][4];
#pragma unroll
        for (u32 i = 0; i < kMTiles; ++i) {
            a[i][0] = word(w[i][0][p], at);      // row g,     k half 0
            a[i][1] = word(w[i][1][p], at);      // row g + 8, k half 0
            a[i][2] = word(w[i][0][p], at + 1);  // row g,     k half 1
            a[i][3] = word(w[i][1][p], at + 1);  // row g + 8, k half 1
        }
#pragma unroll
        for (u32 j = 0; j < kTokenTiles; ++j) {
            if (j >= tiles) continue;
            const u32 b[2] = {word(tk.x[j][p], at), word(tk.x[j][p], at + 1)};
#pragma unroll
            for (u32 i = 0; i < kMTiles; ++i) ptx::mma_m16n8k32_e4m3_f32(sum[i][j], a[i], b);
        }
    }
#pragma unroll
    for (u32 i = 0; i < kMTiles; ++i)
#pragma unroll
        for (u32 j = 0; j < kTokenTiles; ++j) {
            if (j >= tiles) continue;  // its sums are zero and its outputs never written
#pragma unroll
            for (u32 c = 0; c < 4; ++c)  // c even: token 2t, odd: token 2t + 1
                acc[i][j][c] = fmaf(sum[i][j][c], tk.w_scale[i] * tk.x_scale[j][c % 2], acc[i][j][c]);
        }
}

// A pass's first kStages k blocks of weight copies into the warp's ring, one committed group each (empty past
// `kblocks`): warp_gemm's prologue. Weights only - nothing a kernel of the call writes - so a kernel may start its
// first pass's copies before it waits for the kernel ahead of it (moe_decode.cu).
__device__ __forceinline__ void start_weights(uint4* ring, const WarpOperands& op, u32 kblocks) {
    const u32 lane = threadIdx.x % kWarp;
#pragma unroll
    for (u32 kb = 0; kb < kStages; ++kb) {
        if (kb < kblocks) copy_weights(ring, op, kb, lane);
        ptx::cp_async_commit();
    }
}

// One k block of a pass: wait until its copy group landed, its MMAs, then its slot's refill with block kb + kStages.
// Before the refill, __syncwarp: cp.async is unordered with the thread's earlier loads, and the barrier completes
// the slot's reads (already consumed by the MMAs, which are volatile asm ahead of the copy) first.
__device__ __forceinline__ void gemm_step(const WarpOperands& op, uint4* ring, u32 kb, u32 kblocks, const Tokens& tk,
                                          u32 tiles, float (&acc)[kMTiles][kTokenTiles][4]) {
    const u32 lane = threadIdx.x % kWarp;
    ptx::cp_async_wait<kStages - 1>();
    mma_block(ring + (kb % kStages) * kStageVectors, tk, tiles, lane, acc);
    __syncwarp();
    if (kb + kStages < kblocks) copy_weights(ring, op, kb + kStages, lane);
    ptx::cp_async_commit();
}

// The warp's fp32 tiles over `kblocks` k blocks: acc[i][j][c] for m tile i, token tile j, and fragment element c
// (c[0..3] of the MMA: rows g, g, g + 8, g + 8; tokens 2t, 2t + 1, 2t, 2t + 1). `ring`: the warp's
// kStages * kStageVectors vectors of shared memory, into which start_weights(ring, op, kblocks) copies first.
//
// One copy group per k block, committed in k order (an empty one past the last block, so that the count
// stays exact): the first kStages by start_weights, before warp_gemm; block kb + kStages after block kb's MMAs.
// Block kb's group is then the oldest of at most kStages in flight, so waiting until kStages - 1 remain completes
// it. A lane reads back only the vectors it copied itself, so the wait is the only synchronisation before a read.
//
// The token operands alternate between two register sets, even and odd k blocks: block kb + 2's loads are issued
// once block kb's MMAs have read its set, a whole k block ahead of their use.
__device__ __forceinline__ void warp_gemm(const WarpOperands& op, uint4* ring, u32 kblocks, u32 tiles,
                                          float (&acc)[kMTiles][kTokenTiles][4]) {
    const u32 t = threadIdx.x % 4;
#pragma unroll
    for (u32 i = 0; i < kMTiles; ++i)
#pragma unroll
        for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
            for (u32 c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
    Tokens even, odd;
    load_tokens(even, op, 0, t, tiles);
    if (kblocks > 1) load_tokens(odd, op, 1, t, tiles);
    for (u32 kb = 0; kb < kblocks; kb += 2) {
        gemm_step(op, ring, kb, kblocks, even, tiles, acc);
        if (kb + 2 < kblocks) load_tokens(even, op, kb + 2, t, tiles);
        if (kb + 1 < kblocks) {
            gemm_step(op, ring, kb + 1, kblocks, odd, tiles, acc);
            if (kb + 3 < kblocks) load_tokens(odd, op, kb + 3, t, tiles);
        }
    }
}

// An expert's pass over rows [first, first + rows) of its group (rows <= kPassRows, the tokens' FP8 rows
// x [P, K] and scales x_sf at j * sf_stride + p): the token half of the warp's operands, and the token
// tiles in use. Rows past `rows` are null (read as zeros; their outputs are not written).
__device__ __forceinline__ u32 set_tokens(WarpOperands& op, const unsigned char* x, const float* x_sf, u64 first,
                                          u32 rows) {
    const u32 g = threadIdx.x % kWarp / 4, t = threadIdx.x % 4;
#pragma unroll
    for (u32 j = 0; j < kTokenTiles; ++j) {
        const u32 lo = j * kTileTokens;
        const u32 here = rows > lo ? min(rows - lo, kTileTokens) : 0;  // real tokens in tile j
        const u64 p = first + lo;
        op.x_row[j] = g < here ? x + (p + g) * op.k_bytes : nullptr;
#pragma unroll
        for (u32 c = 0; c < 2; ++c) op.x_scale[j][c] = 2 * t + c < here ? x_sf + p + 2 * t + c : nullptr;
    }
    return (rows + kTileTokens - 1) / kTileTokens;
}

}  // namespace chunkring::moe::decode
