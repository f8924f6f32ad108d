// The persistent decode consumer's math warpgroups (device/kernels/moe_persistent.cu): "swap AB" FP8 WGMMA - each
// step's 128 weight rows on the M side, 64 per warpgroup, and the pass's tokens as N (8 to 64) - with DeepGEMM's
// per-128 scale promotion, and the two epilogues.
//
// One step (mma_step): the four k32 WGMMAs of a k block into a fresh fp32 tile (`raw`), then, once they complete, the
// running total acc += raw x (the weight rows' 128x128 block scale) x (each token's 1x128 scale) - as today's decode
// kernels promote (chunkring/moe/decode_gemm.cuh mma_block: fmaf(sum, w_scale * x_scale, acc)), so the tensor core's
// FP8 accumulation never spans more than one k block.
//
// The weights of a step, as the weight loader lays them out (persistent_schedule.cuh): L1 stages hold 8 groups of 16
// rows, each 8 gate rows then the 8 up rows of the same intermediate columns (w13 read through a 5-D tensor map that
// interleaves them), so that a thread's accumulators hold gate (row g) and up (row g + 8) of one column for the same
// tokens (ptx/wgmma.cuh's fragment layout); L2 stages hold 128 consecutive rows of w2.
//
// Rounding as today's decode kernels (device/kernels/moe_decode.cu): L1's sums rounded to bf16 before SwiGLU; SwiGLU,
// the 1x128 absmax, the scale and the e4m3 cast as moe/fp8.cuh; L2's sums rounded to bf16. The order of the sums
// within a k block is the tensor core's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cuda/std/cstdint>

#include "chunkring/moe/fp8.cuh"
#include "chunkring/moe/persistent_schedule.cuh"
#include "chunkring/ptx/mbarrier.cuh"
#include "chunkring/ptx/ordering.cuh"
#include "chunkring/ptx/warpgroup.cuh"
#include "chunkring/ptx/wgmma.cuh"
#include "chunkring/util/stage_pipeline.cuh"

namespace chunkring::moe::persistent {

constexpr u32 kMathBarrier = 1;  // the named barrier of the two math warpgroups (256 threads)

// What the math warpgroups read and write.
struct MathArgs {
    unsigned char* weights;        // the weight stages (shared memory)
    unsigned char* tokens;         // the token tiles, tile_cap rows each
    const float* token_scales;     // the token stages' scales, tile_cap each
    float* amax;                   // [kMathWarps][tile_cap]: the L1 epilogue's per-warp absmax
    util::StagePipeline* weight_pipe;
    util::StagePipeline* token_pipe;
    u32 stages, token_stages;
    Watch watch;
    const float* w13_sf;           // [E, 2I / 128, H / 128]
    const float* w2_sf;            // [E, H / 128, I / 128]
    u64 sf_stride;                 // P: act_sf's scale j of row p at j * P + p
    __nv_fp8_e4m3* act;            // [P, I]
    float* act_sf;                 // [I / 128, P]
    __nv_bfloat16* out;            // [P, H]
    unsigned* done;                // [E]: the expert's quantised L1 passes in this launch
};

// A math thread's place: warpgroup, warp in it, and its fragment coordinates (ptx/wgmma.cuh).
struct MathLane {
    u32 wg, warp, in_wg, g, t;
};

__device__ __forceinline__ MathLane math_lane() {
    const u32 warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    return MathLane{warp / 4, warp, warp % 4, lane / 4, lane % 4};
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One step: waits for the weight and token stages under the cursors, acc += their k block x the scales (`lo` for
// fragment rows g, `hi` for rows g + 8: L1's gate and up block scales; L2's one scale twice), releases both stages.
template <u32 N>
__device__ __forceinline__ void mma_step(const MathArgs& m, u32 tile_cap, util::Cursor& wc, util::Cursor& tc, float lo,
                                         float hi, float (&acc)[N / 2]) {
    const MathLane l = math_lane();
    m.weight_pipe->wait(wc, m.watch.limit_ns, StageFault{m.watch, kFaultWeightStage});
    m.token_pipe->wait(tc, m.watch.limit_ns, StageFault{m.watch, kFaultTokenStage});
    const u64 a = ptx::smem_desc_k_major_sw128(
        ptx::shared_address(m.weights + wc.stage * kWeightStageBytes + l.wg * (kWeightStageBytes / 2)));
    const u64 b = ptx::smem_desc_k_major_sw128(ptx::shared_address(m.tokens + tc.stage * tile_cap * kKBlock));
    // Zeros, though the first WGMMA overwrites them: the asm reads its accumulators ("+f"), and a value left from the
    // last step would otherwise be live across the waits above.
    float raw[N / 2];
#pragma unroll
    for (u32 i = 0; i < N / 2; ++i) raw[i] = 0.0f;
    ptx::wgmma_fence();
#pragma unroll
    for (u32 k = 0; k < kKBlock / 32; ++k)
        ptx::wgmma_m64k32_e4m3_f32<N>(raw, ptx::smem_desc_advance(a, 32 * k), ptx::smem_desc_advance(b, 32 * k), k > 0);
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_operands(raw);
    const float* x_scale = m.token_scales + tc.stage * tile_cap;
#pragma unroll
    for (u32 j = 0; j < N / 8; ++j) {  // each token scale used as it is read
        const float x0 = x_scale[8 * j + 2 * l.t], x1 = x_scale[8 * j + 2 * l.t + 1];
        acc[4 * j + 0] = fmaf(raw[4 * j + 0], lo * x0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(raw[4 * j + 1], lo * x1, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(raw[4 * j + 2], hi * x0, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(raw[4 * j + 3], hi * x1, acc[4 * j + 3]);
    }
    __syncwarp();  // every lane's wgmma reads and scale loads are done before the warp releases the stages
    if (threadIdx.x % kWarp == 0) {
        m.weight_pipe->release(wc);
        m.token_pipe->release(tc);
    }
    wc.advance(m.stages);
    tc.advance(m.token_stages);
}

// L2's epilogue: the pass's real rows of the warpgroup's 64 output columns, bf16.
template <u32 N>
__device__ __forceinline__ void store_rows(const MathArgs& m, const Schedule& s, const Unit& u, const Pass& p,
                                           const float (&acc)[N / 2]) {
    const MathLane l = math_lane();
    const u64 col = static_cast<u64>(u.block) * kTileRows + 64 * l.wg + 16 * l.in_wg + l.g;
#pragma unroll
    for (u32 j = 0; j < N / 8; ++j)
#pragma unroll
        for (u32 c = 0; c < 4; ++c) {
            const u32 token = 8 * j + 2 * l.t + c % 2;
            if (token < p.rows)
                m.out[(static_cast<u64>(p.row0) + token) * s.hidden + col + 8 * (c / 2)] =
                    __float2bfloat16_rn(acc[4 * j + c]);
        }
}

// L1's epilogue for one pass: v[h][2j + c] is SwiGLU of intermediate column 128 chunk + 64h + 32 wg + 8 in_wg + g for
// token 8j + 2t + c. The 256 math threads together hold the chunk's 128 columns for every token of the pass: each
// token's absmax goes through shared memory, then every thread writes its values' e4m3 bytes and warp 0 the scales.
template <u32 N>
__device__ __forceinline__ void quantise(const MathArgs& m, const Schedule& s, const Unit& u, const Pass& p,
                                         const float (&v)[2][N / 4]) {
    const MathLane l = math_lane();
#pragma unroll
    for (u32 i = 0; i < N / 4; ++i) {  // token 8 (i / 2) + 2t + i % 2: its absmax over the warp's 16 values
        float amax = fmaxf(fabsf(v[0][i]), fabsf(v[1][i]));
#pragma unroll
        for (u32 offset = 4; offset < kWarp; offset *= 2)  // over g: the lanes of one t hold the same tokens
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if (l.g == 0) m.amax[l.warp * s.tile_cap + 8 * (i / 2) + 2 * l.t + i % 2] = amax;
    }
    ptx::named_barrier_sync(kMathBarrier, kMathThreads);
    const u64 col = static_cast<u64>(u.block) * kKBlock + 32 * l.wg + 8 * l.in_wg + l.g;
#pragma unroll
    for (u32 i = 0; i < N / 4; ++i) {
        const u32 token = 8 * (i / 2) + 2 * l.t + i % 2;
        float most = 0.0f;
#pragma unroll
        for (u32 w = 0; w < kMathWarps; ++w) most = fmaxf(most, m.amax[w * s.tile_cap + token]);
        const float scale = e4m3_scale(most);
        if (token < p.rows) {
            __nv_fp8_e4m3* row = m.act + (static_cast<u64>(p.row0) + token) * s.inter + col;
            row[0] = __nv_fp8_e4m3(clamp_e4m3(v[0][i] / scale));
            row[64] = __nv_fp8_e4m3(clamp_e4m3(v[1][i] / scale));
            if (l.warp == 0 && l.g == 0) m.act_sf[u.block * m.sf_stride + p.row0 + token] = scale;
        }
    }
    ptx::named_barrier_sync(kMathBarrier, kMathThreads);  // every warp read `amax` before the next pass rewrites it
}

// After a pass quantised a chunk's activation rows: they go to whichever block runs the expert's L2 units - every
// thread's stores fenced for the copy engine (which reads them) and for the GPU, the warpgroups' barrier, then one
// add with release to the expert's counter (the token loader's wait_l1 acquires it).
__device__ __forceinline__ void release_l1(const MathArgs& m, const Unit& u) {
    ptx::fence_proxy_async_global();
    ptx::fence_acq_rel_gpu();
    ptx::named_barrier_sync(kMathBarrier, kMathThreads);
    if (threadIdx.x == 0) ptx::red_add_release_gpu(m.done + u.expert, 1);
}

// One pass of a unit with token tile N: its steps (L1: its two halves, each over H / 128 k blocks; L2: I / 128), then
// its epilogue. The weight scales of the next k block load while the current step waits.
template <u32 kGemm, u32 N>
__device__ __forceinline__ void run_pass(const MathArgs& m, const Schedule& s, const Unit& u, const Pass& p,
                                      util::Cursor& wc, util::Cursor& tc) {
    const u32 kblocks = s.kblocks(kGemm);
    float v[2][N / 4];  // L1: SwiGLU of each half
#pragma unroll
    for (u32 h = 0; h < (kGemm == kL1 ? 2 : 1); ++h) {  // unrolled: v's index a constant
        const float* lo;  // the unit's scale row(s) at k block 0
        const float* hi;
        if constexpr (kGemm == kL1) {
            lo = m.w13_sf + (static_cast<u64>(u.expert) * (2 * s.inter / kTileRows) + u.block) * kblocks;  // gate
            hi = lo + static_cast<u64>(s.inter / kTileRows) * kblocks;                                    // up
        } else {
            lo = hi = m.w2_sf + (static_cast<u64>(u.expert) * (s.hidden / kTileRows) + u.block) * kblocks;
        }
        float acc[N / 2];
#pragma unroll
        for (u32 i = 0; i < N / 2; ++i) acc[i] = 0.0f;
        float scale_lo = __ldg(lo), scale_hi = kGemm == kL1 ? __ldg(hi) : scale_lo;
        for (u32 kb = 0; kb < kblocks; ++kb) {
            float next_lo = scale_lo, next_hi = scale_hi;
            if (kb + 1 < kblocks) {
                next_lo = __ldg(lo + kb + 1);
                next_hi = kGemm == kL1 ? __ldg(hi + kb + 1) : next_lo;
            }
            mma_step<N>(m, s.tile_cap, wc, tc, scale_lo, scale_hi, acc);
            scale_lo = next_lo;
            scale_hi = next_hi;
        }
        if constexpr (kGemm == kL1) {
#pragma unroll
            for (u32 j = 0; j < N / 8; ++j)
#pragma unroll
                for (u32 c = 0; c < 2; ++c)
                    v[h][2 * j + c] = silu_mul(round_bf16(acc[4 * j + c]), round_bf16(acc[4 * j + 2 + c]));
        } else {
            store_rows<N>(m, s, u, p, acc);
        }
    }
    if constexpr (kGemm == kL1) {
        quantise<N>(m, s, u, p, v);
        release_l1(m, u);
    }
}

template <u32 kGemm>
__device__ __forceinline__ void run_pass_of_tile(const MathArgs& m, const Schedule& s, const Unit& u, const Pass& p,
                                                 util::Cursor& wc, util::Cursor& tc) {
    switch (p.tile) {
        case 8: run_pass<kGemm, 8>(m, s, u, p, wc, tc); break;
        case 16: run_pass<kGemm, 16>(m, s, u, p, wc, tc); break;
        case 32: run_pass<kGemm, 32>(m, s, u, p, wc, tc); break;
        default: run_pass<kGemm, 64>(m, s, u, p, wc, tc); break;
    }
}

// Device times a block's math records (global-timer ns; 0: none), in shared memory: registers kept for the math.
struct MathTimes {
    u64 start, first_step, last_l1, last_l2;  // the block started; the first weight stage landed; the last L1 / L2
    u32 l1_units, l2_units;                   // unit done
};

// The math warpgroups' whole work: every unit of this block in list order (thread 0 keeps `times`, zeroed by the
// caller); each pass that quantises releases its rows (release_l1).
__device__ __forceinline__ void run_math(const MathArgs& m, const Schedule& s, const Active& a, UnitWalk<false> walk,
                                         MathTimes& times) {
    util::Cursor wc, tc;
    u32 i = walk.first(s, m.watch);
    // When the first weight stage landed (the first step's own wait then returns at once: no warp releases the stage
    // before its own first step).
    if (threadIdx.x == 0 && i < s.total) {
        m.weight_pipe->wait(wc, m.watch.limit_ns, StageFault{m.watch, kFaultWeightStage});
        times.first_step = ptx::globaltimer_ns();
    }
    for (; i < s.total; i = walk.next(i, s, m.watch)) {
        const Unit u = s.unit(i, a);
        for (u32 p = 0; p < s.passes(u); ++p) {
            if (u.gemm == kL1) {
                run_pass_of_tile<kL1>(m, s, u, s.pass(u, p), wc, tc);
            } else {
                run_pass_of_tile<kL2>(m, s, u, s.pass(u, p), wc, tc);
            }
        }
        if (u.gemm == kL1 && threadIdx.x == 0) {
            times.last_l1 = ptx::globaltimer_ns();
            ++times.l1_units;
        } else if (u.gemm == kL2 && threadIdx.x == 0) {
            times.last_l2 = ptx::globaltimer_ns();
            ++times.l2_units;
        }
    }
}

}  // namespace chunkring::moe::persistent
