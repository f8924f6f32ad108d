// The decode path of the consumer's expert work (runtime/chunkring/moe/_engine/decode.py drives it): for few rows per
// expert, two kernels replace DeepGEMM's L1, moe_swiglu_fp8 and DeepGEMM's L2 (moe_experts.cu) on the same
// plan (moe_plan_scatter's groups), and moe_combine_push runs after them unchanged:
//
//   moe_decode_l1   act = e4m3(silu(gate) * up) per 1x128, [gate, up] = rows @ w13[e]^T
//   moe_decode_l2   out = bf16(act @ w2[e]^T)
//
// Both are "swap AB" FP8 GEMMs (chunkring/moe/decode_gemm.cuh): weight rows on the MMA's 16-wide side,
// tokens on its 8-wide side, each weight byte of an expert with rows read once per pass of up to kPassRows
// of its rows (an expert with more takes more passes; one with none reads nothing). Grid: one block of
// kWarps warps per (local expert, chunk of weight rows), experts outer: a block of an expert without rows
// returns at once, so the blocks of the experts in use spread over the SMs.
//
// Why L2 writes bf16 rows and leaves the combine to moe_combine_push rather than weighting and pushing in
// its epilogue: the push owns the combine's transport (stores to peers, or NVSHMEM puts) and its release
// and arrival count, which the held acks wait for; keeping it one kernel keeps those rules in one place,
// for a cost of one read and write of [rows, H] bf16 - small at decode sizes.
//
// Both are launched with pdl (ptx/dependent_launch.cuh). Before a block waits for the kernel ahead of it (the
// plan's scatter, or L1) it reads only its expert's row count and starts its first pass's weight copies: the
// weights are never written in a call, and the counts are final once the kernel ahead has let us start (that
// kernel releases only after its own wait, and the counts' writer, moe_plan_count or moe_wave_claim, is further
// ahead still). So a block of an idle expert returns without holding an SM through the wait (finish_idle), and
// the first k blocks of an active one's weights load while the scatter, or L1, finishes. Once its wait returns, a
// block lets the next kernel start (nothing here spins) and reads the rest.
//
// Rounding, as the DeepGEMM path rounds, so that both paths answer alike: L1's fp32 sums rounded to bf16
// (DeepGEMM's output type) before SwiGLU; SwiGLU, the 1x128 absmax and the e4m3 cast as moe_swiglu_fp8;
// L2's sums rounded to bf16. The sums themselves differ from DeepGEMM's in order.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cuda/std/cstdint>

#include "chunkring/moe/decode_gemm.cuh"
#include "chunkring/moe/fp8.cuh"
#include "chunkring/moe/kernel_args.cuh"
#include "chunkring/ptx/dependent_launch.cuh"
#include "chunkring/ptx/ordering.cuh"
#include "chunkring/util/kernel_params.cuh"

namespace {

namespace decode = chunkring::moe::decode;
namespace moe = chunkring::moe;
namespace ptx = chunkring::ptx;
using decode::kMTiles;
using decode::kPassRows;
using decode::kScaleRows;
using decode::kTileRows;
using decode::kTokenTiles;
using decode::kWarp;
using decode::kWarps;
using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::moe::DecodeL1Args;
using chunkring::moe::DecodeL2Args;
using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;


// Warp w's weight ring in the block's dynamic shared memory (decode_gemm.cuh warp_gemm).
__device__ __forceinline__ uint4* warp_ring(u32 warp) {
    extern __shared__ uint4 decode_rings[];
    return decode_rings + warp * decode::kStages * decode::kStageVectors;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Expert e's planned rows, read before the block waits for the kernel ahead (see the top): a relaxed GPU-scope
// load, served by L2, where the counts' writer - complete, and its memory flushed, before the kernel ahead of this
// one stopped waiting - left them; no L1 line of an earlier read can answer it.
__device__ __forceinline__ u32 rows_of(const unsigned* counts, u32 e) { return ptx::ld_relaxed_gpu(counts + e); }

// A block of an idle expert ends without waiting for the kernel ahead - except block 0, so that this kernel
// completes only after that kernel has, and whatever follows it in the stream finds every kernel ahead complete.
__device__ __forceinline__ void finish_idle() {
    if (blockIdx.x == 0) ptx::wait_prior_grid();
}

// The expert's first planned row, once the wait returned: group e is rows [group_end[e] - rows, group_end[e]).
__device__ __forceinline__ u64 first_row(const int* group_end, u32 e, u32 rows) {
    return static_cast<u64>(group_end[e]) - rows;
}

// L1's epilogue for one pass: the warp's gate tile (acc[0]) and up tile (acc[1]) hold 16 intermediate columns
// of up to kPassRows tokens; the block's eight warps together hold one 128-column scale block (`chunk`), whose
// per-token absmax goes through shared memory. Writes act [P, I] and act_sf (block `chunk` of row p at
// chunk * sf_stride + p) for the pass's real rows [first, first + rows).
__device__ void swiglu_quantise(const float (&acc)[kMTiles][kTokenTiles][4], u64 first, u32 rows, u32 chunk,
                                u64 inter, u64 sf_stride, __nv_fp8_e4m3* act, float* act_sf) {
    __shared__ float amax_of[kWarps][kPassRows];
    const u32 lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, g = lane / 4, t = lane % 4;
    float v[kTokenTiles][4], amax[kTokenTiles][2] = {};
#pragma unroll
    for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
        for (u32 c = 0; c < 4; ++c) {
            const float gate = round_bf16(acc[0][j][c]), up = round_bf16(acc[1][j][c]);
            v[j][c] = moe::silu_mul(gate, up);
            amax[j][c % 2] = fmaxf(amax[j][c % 2], fabsf(v[j][c]));
        }
    // Over the warp's 16 columns: the lanes of one t (lane bits 2-4 are g) hold the same tokens.
#pragma unroll
    for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
#pragma unroll
            for (u32 offset = 4; offset < kWarp; offset *= 2)
                amax[j][h] = fmaxf(amax[j][h], __shfl_xor_sync(0xffffffffu, amax[j][h], offset));
            if (g == 0) amax_of[warp][j * 8 + 2 * t + h] = amax[j][h];
        }
    __syncthreads();
    float scale[kTokenTiles][2];
#pragma unroll
    for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            float m = 0.0f;
#pragma unroll
            for (u32 w = 0; w < kWarps; ++w) m = fmaxf(m, amax_of[w][j * 8 + 2 * t + h]);
            scale[j][h] = moe::e4m3_scale(m);
        }
    const u64 col = static_cast<u64>(chunk) * kScaleRows + warp * kTileRows + g;
#pragma unroll
    for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
        for (u32 c = 0; c < 4; ++c) {
            const u32 token = j * 8 + 2 * t + c % 2;
            if (token >= rows) continue;
            const float q = moe::clamp_e4m3(v[j][c] / scale[j][c % 2]);
            act[(first + token) * inter + col + (c / 2) * 8] = __nv_fp8_e4m3(q);
        }
    if (warp == 0 && g == 0)
#pragma unroll
        for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 token = j * 8 + 2 * t + h;
                if (token < rows) act_sf[chunk * sf_stride + first + token] = scale[j][h];
            }
    __syncthreads();  // amax_of is rewritten by the next pass
}

}  // namespace

// L1 + SwiGLU + FP8 quantisation. Block (e, chunk) = (blockIdx.x / (inter / 128), blockIdx.x % (inter / 128));
// warp w computes gate rows chunk * 128 + 16w .. + 15 and the same up rows (inter further), for every row of
// expert e's group, and the block quantises the chunk's 128 columns per row.
//   w13 [E_local, 2I, H] e4m3, w13_sf [E_local, 2I / 128, H / 128] fp32 (chunkring.moe.Fp8Weight)
//   rows [P, H] e4m3 (the plan's rows), rows_sf: scale j of row p at j * sf_stride + p
//   counts [E_local], group_end [E_local]: the plan's groups (moe_plan_scatter)
//   act [P, I] e4m3, act_sf: scale j of row p at j * sf_stride + p (only the groups' real rows written)
// Launch: grid E_local * inter / 128, block decode::kThreads, decode::kSharedBytes of dynamic shared memory (the
// warps' weight rings); hidden % 128 == 0, inter % 128 == 0.
extern "C" __global__ void __launch_bounds__(decode::kThreads, 1)
    moe_decode_l1(const __grid_constant__ DecodeL1Args args) {
    require_args(args);
    const auto* w13 = arg<const __nv_fp8_e4m3*>(args.w13);
    const auto* w13_sf = arg<const float*>(args.w13_sf);
    const long long sf_stride = arg<long long>(args.sf_stride);
    const auto* counts = arg<const unsigned*>(args.counts);
    const long long hidden = arg<long long>(args.hidden);
    const long long inter = arg<long long>(args.inter);
    const u64 H = static_cast<u64>(hidden), I = static_cast<u64>(inter);
    const u32 chunks = static_cast<u32>(I / kScaleRows), e = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
    const u32 planned = rows_of(counts, e);
    if (planned == 0) {  // uniform across the block: an idle expert's weights are never read
        finish_idle();
        return;
    }
    const u32 warp = threadIdx.x / kWarp, g = threadIdx.x % kWarp / 4;
    const u32 kblocks = static_cast<u32>(H / decode::kKBlock);
    const u64 scale_rows = 2 * I / kScaleRows;
    const auto* w = reinterpret_cast<const unsigned char*>(w13);
    decode::WarpOperands op{};
    op.k_bytes = H;
    op.sf_stride = static_cast<u64>(sf_stride);
    const u64 row0 = static_cast<u64>(chunk) * kScaleRows + warp * kTileRows + g;  // gate row g of the warp's tile
    op.w_row[0] = w + (e * 2 * I + row0) * H;
    op.w_row[1] = w + (e * 2 * I + I + row0) * H;  // its up row
    op.w_scale[0] = w13_sf + (e * scale_rows + chunk) * kblocks;
    op.w_scale[1] = w13_sf + (e * scale_rows + I / kScaleRows + chunk) * kblocks;
    decode::start_weights(warp_ring(warp), op, kblocks);  // the first pass's, while the kernel ahead finishes
    ptx::wait_prior_grid();
    ptx::release_dependents();
    const auto* rows = arg<const unsigned char*>(args.rows);
    const auto* rows_sf = arg<const float*>(args.rows_sf);
    const auto* group_end = arg<const int*>(args.group_end);
    auto* act = arg<__nv_fp8_e4m3*>(args.act);
    auto* act_sf = arg<float*>(args.act_sf);
    const u64 first = first_row(group_end, e, planned);
    float acc[kMTiles][kTokenTiles][4];
    for (u32 done = 0; done < planned; done += kPassRows) {
        if (done > 0) decode::start_weights(warp_ring(warp), op, kblocks);
        const u32 here = min(planned - done, kPassRows);
        const u32 tiles = decode::set_tokens(op, rows, rows_sf, first + done, here);
        decode::warp_gemm(op, warp_ring(warp), kblocks, tiles, acc);
        swiglu_quantise(acc, first + done, here, chunk, I, op.sf_stride, act, act_sf);
    }
}

// L2. Block (e, chunk) = (blockIdx.x / (hidden / 256), blockIdx.x % (hidden / 256)); warp w computes output
// columns chunk * 256 + 16w .. + 15 (m tile 0) and 128 further (m tile 1) for every row of expert e's group.
//   w2 [E_local, H, I] e4m3, w2_sf [E_local, H / 128, I / 128] fp32 (chunkring.moe.Fp8Weight)
//   act [P, I] e4m3, act_sf: scale j of row p at j * sf_stride + p (moe_decode_l1's output)
//   out [P, H] bf16: the groups' real rows written, others untouched
// Launch: grid E_local * hidden / 256, block decode::kThreads, decode::kSharedBytes of dynamic shared memory;
// hidden % 256 == 0, inter % 128 == 0.
extern "C" __global__ void __launch_bounds__(decode::kThreads, 1)
    moe_decode_l2(const __grid_constant__ DecodeL2Args args) {
    require_args(args);
    const auto* w2 = arg<const __nv_fp8_e4m3*>(args.w2);
    const auto* w2_sf = arg<const float*>(args.w2_sf);
    const long long sf_stride = arg<long long>(args.sf_stride);
    const auto* counts = arg<const unsigned*>(args.counts);
    const long long hidden = arg<long long>(args.hidden);
    const long long inter = arg<long long>(args.inter);
    const u64 H = static_cast<u64>(hidden), I = static_cast<u64>(inter);
    const u32 chunks = static_cast<u32>(H / (kMTiles * kScaleRows)), e = blockIdx.x / chunks,
              chunk = blockIdx.x % chunks;
    const u32 planned = rows_of(counts, e);
    if (planned == 0) {  // uniform across the block
        finish_idle();
        return;
    }
    const u32 warp = threadIdx.x / kWarp, g = threadIdx.x % kWarp / 4, t = threadIdx.x % 4;
    const u32 kblocks = static_cast<u32>(I / decode::kKBlock);
    const u64 scale_rows = H / kScaleRows;
    const auto* w = reinterpret_cast<const unsigned char*>(w2);
    decode::WarpOperands op{};
    op.k_bytes = I;
    op.sf_stride = static_cast<u64>(sf_stride);
    u64 col[kMTiles];  // row g of each m tile: the output column it gives
#pragma unroll
    for (u32 i = 0; i < kMTiles; ++i) {
        const u64 block = static_cast<u64>(chunk) * kMTiles + i;  // its 128-row scale block
        col[i] = block * kScaleRows + warp * kTileRows + g;
        op.w_row[i] = w + (e * H + col[i]) * I;
        op.w_scale[i] = w2_sf + (e * scale_rows + block) * kblocks;
    }
    decode::start_weights(warp_ring(warp), op, kblocks);  // the first pass's, while L1 finishes
    ptx::wait_prior_grid();
    ptx::release_dependents();
    const auto* act = arg<const __nv_fp8_e4m3*>(args.act);
    const auto* act_sf = arg<const float*>(args.act_sf);
    const auto* group_end = arg<const int*>(args.group_end);
    auto* out = arg<__nv_bfloat16*>(args.out);
    const u64 group_first = first_row(group_end, e, planned);
    float acc[kMTiles][kTokenTiles][4];
    for (u32 done = 0; done < planned; done += kPassRows) {
        if (done > 0) decode::start_weights(warp_ring(warp), op, kblocks);
        const u32 here = min(planned - done, kPassRows);
        const u64 first = group_first + done;
        const u32 tiles = decode::set_tokens(op, reinterpret_cast<const unsigned char*>(act), act_sf, first, here);
        decode::warp_gemm(op, warp_ring(warp), kblocks, tiles, acc);
#pragma unroll
        for (u32 i = 0; i < kMTiles; ++i)
#pragma unroll
            for (u32 j = 0; j < kTokenTiles; ++j)
#pragma unroll
                for (u32 c = 0; c < 4; ++c) {  // c: rows g, g, g + 8, g + 8 of the tile; tokens 2t, 2t + 1
                    const u32 token = j * 8 + 2 * t + c % 2;
                    if (token < here) out[(first + token) * H + col[i] + (c / 2) * 8] = __float2bfloat16_rn(acc[i][j][c]);
                }
    }
}
