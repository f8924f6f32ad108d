// The MoE layer's producers: the router GEMM, then one fused kernel per chunk that takes the router's logits
// and the chunk's hidden rows and publishes the chunk - top-k of the logits with renormalised softmax weights,
// the rows quantised to FP8 with one fp32 scale per 128 columns (bf16 payload: the rows as they are), written
// straight into the ring slot, then the slot's metadata and both ready words.
//
//   moe_router_logits  the router GEMM on the tensor cores, batch-invariant: a token's logits are the same
//                      bits whether its chunk or its whole batch shares the launch
//   moe_produce_chunk  a grid; every block waits until the slot is free (begin_chunk), computes its share
//                      of the rows into the slot and arrives on `arrivals`; the last block to arrive
//                      publishes the chunk (close_chunk). One block needs no arrival count.
//
// Ordering (docs/PROTOCOL.md, "Ordering, edge by edge", the fused producer): each block acquires the slot
// itself (begin_chunk); protocol/ring.cuh last_block_to_arrive orders every block's slot stores before the
// last block's publish, whose system-scope release fence is cumulative over them. A block whose
// begin_chunk fails (an error recorded) never arrives, so nothing is published over a slot still in use.
//
// What it computes matches chunkring.moe._engine.producer's torch reference (route, quantize_rows_fp8):
//   - routing: the K largest logits (a NaN ranks above everything, as torch.topk ranks it; equal logits:
//     the lower expert first); weight_k = exp(l_k - l_max) / sum_j exp(l_j - l_max) over the K chosen -
//     softmax renormalised over the chosen, whose full-row denominator cancels. A few ulps from torch's
//     softmax-then-renormalise, never a different choice but for equal logits;
//   - FP8 rows: bitwise torch's quantize_rows_fp8 (IEEE divisions, NaN kept, a non-positive or NaN scale
//     replaced by 1, the clamp to +-448 before the round-to-nearest-even cast).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "chunkring/moe/fp8.cuh"
#include "chunkring/moe/kernel_args.cuh"
#include "chunkring/protocol/publish.cuh"
#include "chunkring/ptx/mma.cuh"
#include "chunkring/util/kernel_params.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::moe::ProduceChunkArgs;

namespace {

constexpr u32 kWarp = 32;
constexpr u64 kScaleBlock = 128;     // columns per FP8 scale (runtime/chunkring/ring/spec.py FP8_SCALE_BLOCK)

// The router GEMM's tiling (runtime/chunkring/moe/_engine/producer.py router_slices mirrors kRouterSlice and
// kRouterMaxSlices): a block computes 16 tokens x 32 experts; its warps split the hidden columns into
// slices of a fixed length, each summed by the tensor cores in one fixed order, and the slices' sums are
// added in slice order. Every choice depends on the hidden size alone, never on the token count.
constexpr int kRouterRows = 16;       // the MMA's M
constexpr int kRouterCols = 32;       // four MMA N tiles of 8 experts
constexpr int kRouterSlice = 512;     // hidden columns per warp, at least (a multiple of the MMA's K, 16)
constexpr int kRouterMaxSlices = 16;  // warps per block at most

// Two adjacent bf16 as one MMA fragment register (the lower column in the low half); 0 for a padding row.
__device__ __forceinline__ u32 bf16_pair(const __nv_bfloat16* p, bool real) {
    return real ? *reinterpret_cast<const u32*>(p) : 0u;
}

// One warp's slice [k_lo, k_hi) of a 16 x 32 tile's sums: acc[j] is the MMA C fragment of experts
// c0 + 8j .. c0 + 8j + 7. Rows past n and experts past num_experts read as 0.
__device__ void router_slice(const __nv_bfloat16* hidden, const __nv_bfloat16* router, int n, int num_experts,
                             int hidden_size, int r0, int c0, int k_lo, int k_hi, float (&acc)[4][4]) {
    const int lane = static_cast<int>(threadIdx.x % kWarp), g = lane / 4, t = lane % 4;
    const bool real_a = r0 + g < n, real_b = r0 + g + 8 < n;
    const __nv_bfloat16* row_a = hidden + static_cast<long long>(real_a ? r0 + g : 0) * hidden_size + 2 * t;
    const __nv_bfloat16* row_b = hidden + static_cast<long long>(real_b ? r0 + g + 8 : 0) * hidden_size + 2 * t;
    bool real_e[4];
    const __nv_bfloat16* expert[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int e = c0 + 8 * j + g;
        real_e[j] = e < num_experts;
        expert[j] = router + static_cast<long long>(real_e[j] ? e : 0) * hidden_size + 2 * t;
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    }
#pragma unroll 4
    for (int k = k_lo; k < k_hi; k += 16) {
        const u32 a[4] = {bf16_pair(row_a + k, real_a), bf16_pair(row_b + k, real_b), bf16_pair(row_a + k + 8, real_a),
                          bf16_pair(row_b + k + 8, real_b)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 b[2] = {bf16_pair(expert[j] + k, real_e[j]), bf16_pair(expert[j] + k + 8, real_e[j])};
            ptx::mma_m16n8k16_bf16_f32(acc[j], a, b);
        }
    }
}

// A candidate expert: its logit's rank key (rank_key) and its index; idx < 0 = none.
struct Pick {
    u32 key;
    int idx;
};

// The logit as an unsigned key in torch.topk's order: a larger float a larger key, -0 and +0 equal, and NaN (of
// either sign) above +inf. A float key cannot put NaN above +inf: NaN compares false with everything.
__device__ __forceinline__ u32 rank_key(float logit) {
    if (isnan(logit)) return 0xffffffffu;
    const u32 bits = __float_as_uint(logit == 0.0f ? 0.0f : logit);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // negatives reversed below the positives
}

// a before b in the top-k order: larger key first, then the lower index; a real pick before none.
__device__ __forceinline__ bool before(const Pick& a, const Pick& b) {
    if (a.idx < 0 || b.idx < 0) return b.idx < 0 && a.idx >= 0;
    return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

// One warp routes one token: K rounds, each taking the best logit strictly after the previous pick in the
// top-k order (so nothing is excluded by a list). Writes idx[K] and weights[K].
__device__ void route_token(const float* logits, int num_experts, int topk, int* idx, float* weights) {
    const u32 lane = threadIdx.x % kWarp;
    Pick prev{0u, -1};  // none yet: every expert is eligible
    float top_logit = 0.0f, my_logit = 0.0f;
    for (int k = 0; k < topk; ++k) {
        Pick best{0u, -1};
        for (int e = static_cast<int>(lane); e < num_experts; e += kWarp) {
            const Pick cand{rank_key(logits[e]), e};
            if ((prev.idx < 0 || before(prev, cand)) && before(cand, best)) best = cand;
        }
#pragma unroll
        for (u32 offset = kWarp / 2; offset > 0; offset /= 2) {
            const Pick other{__shfl_xor_sync(0xffffffffu, best.key, offset), __shfl_xor_sync(0xffffffffu, best.idx, offset)};
            if (before(other, best)) best = other;
        }
        prev = best;  // warp-uniform; num_experts >= topk, so it is a real pick
        const float logit = logits[best.idx];
        if (k == 0) top_logit = logit;
        if (lane == static_cast<u32>(k)) my_logit = logit;  // topk <= 32: lane k keeps pick k
        if (lane == 0) idx[k] = best.idx;
    }
    const float e = static_cast<int>(lane) < topk ? expf(my_logit - top_logit) : 0.0f;
    float sum = e;
#pragma unroll
    for (u32 offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (static_cast<int>(lane) < topk) weights[lane] = e / sum;
}

// One warp quantises 128 columns of a row: absmax -> scale = absmax / 448 (1 if not positive or NaN) ->
// each value / scale, clamped to +-448 (NaN kept), rounded to nearest e4m3.
__device__ void quantize_block(const __nv_bfloat16* in, unsigned char* out, float* scale_out) {
    const u32 lane = threadIdx.x % kWarp;
    const uint2 raw = *reinterpret_cast<const uint2*>(in + lane * 4);
    const auto* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
    float x[4], amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        x[j] = __bfloat162float(v[j]);
        const float a = fabsf(x[j]);
        amax = (a > amax || isnan(a)) ? a : amax;  // NaN wins, as torch's amax
    }
#pragma unroll
    for (u32 offset = kWarp / 2; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, amax, offset);
        amax = (other > amax || isnan(other)) ? other : amax;
    }
    const float scale = moe::e4m3_scale(amax);
    __align__(4) __nv_fp8_e4m3 q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float y = x[j] / scale;
        q[j] = __nv_fp8_e4m3(isnan(y) ? y : moe::clamp_e4m3(y));  // NaN stays NaN: the input checks report it
    }
    *reinterpret_cast<u32*>(out + lane * 4) = *reinterpret_cast<const u32*>(q);
    if (lane == 0) *scale_out = scale;
}

// This block's share of rows [0, n): routing and the payload rows, one warp per task.
__device__ void produce_rows(const RingDesc& d, u64 slot, const float* logits, const __nv_bfloat16* hidden, u64 n,
                             int num_experts) {
    const u64 lo = n * blockIdx.x / gridDim.x, hi = n * (blockIdx.x + 1) / gridDim.x, rows = hi - lo;
    const u64 H = d.hidden, K = d.topk, col_blocks = H / kScaleBlock;
    const bool fp8 = d.payload_format == 0;
    const u32 lane = threadIdx.x % kWarp;
    const u64 warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
    for (u64 task = warp; task < rows * (1 + col_blocks); task += warps) {
        if (task < rows) {
            const u64 row = lo + task;
            route_token(logits + row * static_cast<u64>(num_experts), num_experts, static_cast<int>(K),
                        slot_topk_idx(d, slot) + row * K, slot_topk_weights(d, slot) + row * K);
            continue;
        }
        const u64 row = lo + (task - rows) / col_blocks, block = (task - rows) % col_blocks;
        const __nv_bfloat16* in = hidden + row * H + block * kScaleBlock;
        unsigned char* out = slot_x(d, slot) + row * d.x_row_bytes;
        if (fp8) {
            quantize_block(in, out + block * kScaleBlock, slot_x_sf(d, slot) + row * d.x_sf_row_floats + block);
        } else {  // bf16: 128 columns = 256 bytes, 8 per lane
            reinterpret_cast<uint2*>(out + block * kScaleBlock * 2)[lane] = reinterpret_cast<const uint2*>(in)[lane];
        }
    }
}

}  // namespace

// logits fp32 [n, num_experts] = hidden bf16 [n, hidden_size] . router bf16 [num_experts, hidden_size]^T (both
// contiguous; hidden_size a multiple of 16). Launch: blockDim = 32 x router_slices(hidden_size) warps, any grid
// (blocks loop over the 16 x 32 tiles). Batch-invariant: a logit is its tile's slices, each summed in one
// fixed order, added in slice order - so it depends on its token's row and the router alone.
extern "C" __global__ void moe_router_logits(const __nv_bfloat16* hidden, const __nv_bfloat16* router, float* logits,
                                             int n, int num_experts, int hidden_size) {
    __shared__ float partial[kRouterMaxSlices][kRouterRows * kRouterCols];
    const int slices = static_cast<int>(blockDim.x / kWarp), warp = static_cast<int>(threadIdx.x / kWarp);
    if (slices > kRouterMaxSlices || blockDim.x % kWarp || hidden_size % 16) return;  // not a launch of ours
    const int lane = static_cast<int>(threadIdx.x % kWarp), g = lane / 4, t = lane % 4;
    const int slice_len = (hidden_size / 16 + slices - 1) / slices * 16;
    const int k_lo = min(warp * slice_len, hidden_size), k_hi = min(k_lo + slice_len, hidden_size);
    const int col_tiles = (num_experts + kRouterCols - 1) / kRouterCols;
    const long long tiles = static_cast<long long>((n + kRouterRows - 1) / kRouterRows) * col_tiles;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int r0 = static_cast<int>(tile / col_tiles) * kRouterRows, c0 = static_cast<int>(tile % col_tiles) * kRouterCols;
        float acc[4][4];
        router_slice(hidden, router, n, num_experts, hidden_size, r0, c0, k_lo, k_hi, acc);
        float* mine = partial[warp];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = 8 * j + 2 * t;
            mine[g * kRouterCols + col] = acc[j][0];
            mine[g * kRouterCols + col + 1] = acc[j][1];
            mine[(g + 8) * kRouterCols + col] = acc[j][2];
            mine[(g + 8) * kRouterCols + col + 1] = acc[j][3];
        }
        __syncthreads();
        for (int o = static_cast<int>(threadIdx.x); o < kRouterRows * kRouterCols; o += static_cast<int>(blockDim.x)) {
            float sum = partial[0][o];
            for (int s = 1; s < slices; ++s) sum += partial[s][o];  // the slices in order
            const int row = r0 + o / kRouterCols, col = c0 + o % kRouterCols;
            if (row < n && col < num_experts) logits[static_cast<long long>(row) * num_experts + col] = sum;
        }
        __syncthreads();  // partial is rewritten by the next tile
    }
}

// Publish rows [0, n_tokens) as this rank's next chunk, rows [token_base, token_base + n_tokens) of its
// batch: logits fp32 [n, num_experts] (the router GEMM's output), hidden bf16 [n, hidden] (both
// contiguous). valid_tokens / batch_rows: a device token count that may cut the chunk short (chunk_extent).
// arrivals (nullable for a one-block grid): one counter, zero before the launch (the last block leaves it
// zero; after a failed launch MoELayer.reset zeroes it).
extern "C" __global__ void moe_produce_chunk(const __grid_constant__ ProduceChunkArgs args) {
    require_args(args);
    const auto* desc = arg<const RingDesc*>(args.desc);
    const auto* logits = arg<const float*>(args.logits);
    const auto* hidden = arg<const __nv_bfloat16*>(args.hidden);
    const int num_experts = arg<int>(args.num_experts);
    const int n_tokens = arg<int>(args.n_tokens);
    const long long token_base = arg<long long>(args.token_base);
    const int end_of_stream = arg<int>(args.end_of_stream);
    const auto* valid_tokens = arg<const int*>(args.valid_tokens);  // null: no device token count
    const long long batch_rows = arg<long long>(args.batch_rows);
    auto* arrivals = arg<unsigned*>(args.arrivals);  // null for a one-block grid
    const RingDesc& d = *desc;
    if (!check_descriptor(d) || has_error(d)) return;
    const ChunkExtent e = chunk_extent(d, n_tokens, token_base, end_of_stream, valid_tokens, batch_rows,
                                       blockIdx.x == 0);
    if (!e.publish) return;  // grid-uniform
    const u64 epoch = current_epoch(d), seq = next_seq(d), slot = slot_of(seq, d.num_slots);
    if (!begin_chunk(d, epoch, seq)) return;  // recorded; this block never arrives, so nothing is published
    // The rows before the arrival: the last block's publish is ordered after every block's stores.
    constexpr bool kRowsFirst = kMutant != Mutant::kArriveBeforeRows;  // the mutant: arrive, then store
    if constexpr (kRowsFirst) produce_rows(d, slot, logits, hidden, e.n, num_experts);
    if (arrivals == nullptr || last_block_to_arrive(arrivals, gridDim.x)) close_chunk(d, epoch, seq, e, token_base);
    if constexpr (!kRowsFirst) produce_rows(d, slot, logits, hidden, e.n, num_experts);
}
