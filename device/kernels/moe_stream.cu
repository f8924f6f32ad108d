// Kernels of the streamed MoE layer (runtime/moe_layer.py) that touch the ring or a peer's memory.
// The math between them (dispatch plan, expert GEMMs, SwiGLU) is torch, on fixed shapes.
//
// One chunk step at a destination rank is:
//   moe_pull_step      wait for every active source's next chunk, copy its rows routed here
//   (torch)            plan, L1 -> SwiGLU -> L2, weight by topk_weights
//   moe_combine_push   write each weighted row into its source's combine buffer, at (token, k)
//   moe_ack_step       acknowledge the step's chunks: the slot's reuse waits for the combine (RFC's
//                      conservative rule), so an acknowledged chunk's results have landed at its source
// and each source, after publishing its last chunk, runs moe_drain before reducing its combine buffer.
#include "chunkring/protocol/ring.cuh"
#include "chunkring/protocol/validate.cuh"
#include "chunkring/util/copy.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
using chunkring::util::block_copy4;

namespace {

constexpr u32 kWarp = 32;

// Per source rank, what a step pulled: read by the torch plan and by moe_ack_step.
enum StepMetaWord : u64 { kStepActive = 0, kStepTokenBase = 1, kStepNumTokens = 2, kStepSeq = 3, kStepMetaWords = 4 };

}  // namespace

// One block per source rank. If the source's stream has not ended: wait for its next chunk, copy
// topk_idx/topk_weights of every row, and x/x_sf of the rows with a choice in [expert_lo, expert_hi).
// Every value used as a count, an index or a scale is checked first (protocol/validate.cuh: masked and
// reported, never trusted); the chunk is acknowledged either way, so a malformed chunk stalls nobody.
// The other rows of the stage keep stale bytes: the plan never reads them.
//   ended [W] int32 (1 = stream ended; zeroed by the host before the first step of an invocation)
//   step_meta [W, 4] int64 (StepMetaWord)
//   stage_x [W, T, x_row_bytes]   stage_sf [W, T, x_sf_row_floats]   stage_idx / stage_w [W, T, K]
extern "C" __global__ void moe_pull_step(const RingDesc* desc, int* ended, long long* step_meta,
                                         unsigned char* stage_x, float* stage_sf, int* stage_idx, float* stage_w,
                                         long long token_capacity, int expert_lo, int expert_hi) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 src = blockIdx.x, T = d.tokens_per_slot, K = d.topk;
    long long* meta_out = step_meta + src * kStepMetaWords;
    __shared__ u64 s_seq, s_n;
    __shared__ bool s_ok;
    if (ended[src]) {  // block-uniform: one word, read by every thread
        if (threadIdx.x == 0) meta_out[kStepActive] = meta_out[kStepNumTokens] = 0;
        return;
    }
    const u64 epoch = current_epoch(d);
    // NOTES: relaxed - this consumer alone writes its cursor (ack_chunk, in an earlier kernel).
    if (threadIdx.x == 0) s_seq = ptx::ld_relaxed_sys(cursor_word(d, src));
    __syncthreads();
    const u64 seq = s_seq, slot = slot_of(seq, d.num_slots);
    bool ok = wait_chunk(d, epoch, src, seq);
    if (threadIdx.x == 0) {
        const u64* meta = ok ? peer_view(d, slot_meta(d, slot), src) : nullptr;
        if (ok && meta == nullptr) record_error(d, ErrorCode::kPeerUnreachable, Site::kPayload, src, slot, 0, 0);
        s_ok = meta != nullptr;
        u64 base = 0;
        s_n = 0;
        if (s_ok) {
            base = meta[kMetaTokenBase];
            s_n = checked_chunk_rows(d, src, slot, base, meta[kMetaNumTokens], static_cast<u64>(token_capacity));
            if (meta[kMetaFlags] & kMetaEndOfStream) ended[src] = 1;
        } else {
            ended[src] = 1;  // a recorded error: the rank's waits now stop, its call ends
        }
        meta_out[kStepActive] = s_ok;
        meta_out[kStepTokenBase] = s_n ? static_cast<long long>(base) : 0;
        meta_out[kStepNumTokens] = static_cast<long long>(s_n);
        meta_out[kStepSeq] = static_cast<long long>(seq);
    }
    __syncthreads();
    if (!s_ok) return;
    const u64 n = s_n;
    int* idx = stage_idx + src * T * K;
    const int* peer_idx = peer_view(d, slot_topk_idx(d, slot), src);
    for (u64 i = threadIdx.x; i < n * K; i += blockDim.x) idx[i] = checked_expert(d, src, slot, i / K, i % K, peer_idx[i]);
    block_copy4(stage_w + src * T * K, peer_view(d, slot_topk_weights(d, slot), src), n * K);
    __syncthreads();

    // A warp per row: the row's K choices decide (one lane each) whether this rank needs its payload.
    const u32 lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
    const u64 row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats;
    const auto* peer_x = reinterpret_cast<const unsigned char*>(peer_view(d, slot_x(d, slot), src));
    const float* peer_sf = peer_view(d, slot_x_sf(d, slot), src);
    for (u64 row = threadIdx.x / kWarp; row < n; row += warps) {
        bool mine = false;
        for (u64 k = lane; k < K; k += kWarp) {
            const int e = idx[row * K + k];
            mine |= e >= expert_lo && e < expert_hi;
        }
        if (!__any_sync(0xffffffffu, mine)) continue;
        const u64 dst_row = src * T + row;
        const auto* from = reinterpret_cast<const int4*>(peer_x + row * row_bytes);
        auto* to = reinterpret_cast<int4*>(stage_x + dst_row * row_bytes);
        for (u64 i = lane; i < row_bytes / 16; i += kWarp) to[i] = from[i];
        for (u64 i = lane; i < sf_floats; i += kWarp)
            stage_sf[dst_row * sf_floats + i] = checked_scale(d, src, slot, row, i, peer_sf[row * sf_floats + i]);
    }
}

// One block per padded row of the step: a real row (row_src >= 0) goes to its source's combine
// buffer at row token * K + k. `combine` is this rank's copy of the symmetric buffer; nvshmem_ptr
// gives each source's copy (load/store reachable peers only, checked by the host at construction).
//   weighted [P, H] fp32   row_src / row_token / row_k [P] int64 (-1 for padding rows)
//   combine [capacity * K, H] fp32 (symmetric)
extern "C" __global__ void moe_combine_push(const RingDesc* desc, const float* weighted, const long long* row_src,
                                            const long long* row_token, const long long* row_k, float* combine,
                                            long long hidden) {
    const RingDesc& d = *desc;
    const long long src = row_src[blockIdx.x];
    if (src < 0) return;
    const u64 H = static_cast<u64>(hidden);
    float* peer = static_cast<float*>(nvshmem_ptr(combine, static_cast<int>(src)));
    const u64 row = static_cast<u64>(row_token[blockIdx.x]) * d.topk + static_cast<u64>(row_k[blockIdx.x]);
    const auto* from = reinterpret_cast<const float4*>(weighted + blockIdx.x * H);
    auto* to = reinterpret_cast<float4*>(peer + row * H);
    for (u64 i = threadIdx.x; i < H / 4; i += blockDim.x) to[i] = from[i];
}

// One block per source rank: acknowledge the chunk this step pulled from it, if any. Stream order puts
// this after moe_combine_push, whose stores the ack's system-scope release fence then orders before
// the acknowledgement (kernel completion orders a kernel's stores before the next kernel in the stream).
extern "C" __global__ void moe_ack_step(const RingDesc* desc, const long long* step_meta) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const long long* meta = step_meta + blockIdx.x * kStepMetaWords;
    if (!meta[kStepActive]) return;
    ack_chunk(d, current_epoch(d), blockIdx.x, static_cast<u64>(meta[kStepSeq]));
}

// One block: wait until every destination acknowledged every chunk this rank published, so every
// combine row for this rank's tokens has landed (see moe_ack_step) and its combine buffer can be reduced.
extern "C" __global__ void moe_drain(const RingDesc* desc) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    drain(d, current_epoch(d));
}
