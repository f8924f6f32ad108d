// Kernels of the MoE layer (runtime/moe/layer.py) that use the ring. The expert work between the pull
// and the held acknowledgement is moe_experts.cu's (plan, SwiGLU, combine push) and the GEMM engine's.
//
// One call at a destination rank, on its consumer stream:
//   moe_pull           every chunk of every source, as it arrives: copy its rows routed here into the
//                      stage at their token index, and acknowledge it - except each source's last
//                      chunk, whose acknowledgement is held (the ring's deferred ack)
//   (moe_experts.cu)   plan the staged rows into expert groups, L1 -> SwiGLU -> L2, and push each
//                      weighted row into its source's combine buffer at (token, k)
//   moe_ack_held       acknowledge each source's last chunk: its owner's drain then knows every combine
//                      row for it has landed
// and each source, after publishing its last chunk, runs moe_drain before reducing its combine buffer.
// So the expert weights are read once per call however many chunks the producers publish (RFC
// dispatch option 2, cross-chunk expert groups, with the end of every stream as the one seal), while
// pulls overlap the producers' later chunks and free each slot as soon as it was copied.
#include "chunkring/protocol/ring.cuh"
#include "chunkring/protocol/validate.cuh"
#include "chunkring/util/copy.cuh"
#include "chunkring/util/kernel_params.cuh"
#include "chunkring/moe/timeline.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
namespace timeline = chunkring::moe::timeline;

namespace {

constexpr u32 kWarp = 32;
// held[src] before a call's pull: no chunk of src is waiting for its acknowledgement.
constexpr u64 kNoHeldChunk = ~0ull;

}  // namespace

// One call's pull, any grid: consume_invocation over every source; each block copies its share of every
// chunk's rows into the stage at [src, token_base + row] - routing (checked, protocol/validate.cuh) and
// weights of every row, the payload of rows with a choice in [expert_lo, expert_hi). Other stage rows
// keep what the host filled (topk_idx -1: planned nowhere) or stale bytes the plan never reads.
// Every chunk but a source's last is acknowledged as soon as every block copied it: nothing the call
// reads later is slot-resident (the RFC's early input_consumed). The last is held (held[src] = its
// seq) for moe_ack_held.
//   arrivals [W * S] (null for one block; zeroed by the host before the launch)   held [W] (kNoHeldChunk)
//   stage_x [W, N, x_row_bytes]   stage_sf [W, N, x_sf_row_floats]   stage_idx / stage_w [W, N, K]
//   trace (nullable): timeline.cuh's buffer of trace_capacity records (observed, pulled, acked)
extern "C" __global__ void moe_pull(const RingDesc* desc, CHUNKRING_NULLABLE unsigned* arrivals,
                                    unsigned long long* held, unsigned char* stage_x, float* stage_sf,
                                    int* stage_idx, float* stage_w, long long token_capacity, int expert_lo,
                                    int expert_hi, CHUNKRING_NULLABLE long long* trace, long long trace_capacity) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 N = static_cast<u64>(token_capacity), T = d.tokens_per_slot, K = d.topk;
    const u64 row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats;
    const bool first_thread = threadIdx.x == 0 && blockIdx.x == 0;  // reports and traces for the grid
    __shared__ long long chunk_of[kMaxWorldSize];  // per source: the chunk being pulled, for the trace
    auto visit = [&](u64 src, u64, u64 slot) {
        // Every read of the slot below is a fetch (protocol/transport.cuh): loads through nvshmem_ptr or
        // NVSHMEM gets, as the descriptor says for src; all of them complete before this visit returns,
        // so before the chunk's acknowledgement.
        ChunkMeta meta;
        if (!chunk_meta(d, src, slot, meta)) return false;
        const u64 base = meta.token_base;
        const u64 n = checked_chunk_rows(d, src, slot, base, meta.num_tokens, N, first_thread);
        if (first_thread) {
            chunk_of[src] = n ? static_cast<long long>(base / T) : 0;
            timeline::record(trace, trace_capacity, timeline::kObserved, src, chunk_of[src]);
        }
        // This block's share: rows [lo, hi) of the chunk.
        const u64 lo = n * blockIdx.x / gridDim.x, hi = n * (blockIdx.x + 1) / gridDim.x;
        const u64 first_row = src * N + (n ? base : 0);  // the chunk's row 0 in the stage
        int* idx = stage_idx + first_row * K;
        // Routing and weights of every row of the share land in the stage raw; the routing is checked in
        // place (fetch_block returns with the bytes visible to the whole block).
        fetch_block(d, idx + lo * K, slot_topk_idx(d, slot) + lo * K, (hi - lo) * K * sizeof(int), src);
        fetch_block(d, stage_w + (first_row + lo) * K, slot_topk_weights(d, slot) + lo * K,
                    (hi - lo) * K * sizeof(float), src);
        for (u64 i = lo * K + threadIdx.x; i < hi * K; i += blockDim.x)
            idx[i] = checked_expert(d, src, slot, i / K, i % K, idx[i]);
        __syncthreads();  // idx is read back below by other warps of the block

        // A warp per row: the row's K choices decide (one lane each) whether this rank needs its payload.
        const u32 lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
        auto mine = [&](u64 row) {
            bool any = false;
            for (u64 k = lane; k < K; k += kWarp) {
                const int e = idx[row * K + k];
                any |= e >= expert_lo && e < expert_hi;
            }
            return __any_sync(0xffffffffu, any);
        };
        for (u64 row = lo + threadIdx.x / kWarp; row < hi; row += warps) {
            if (!mine(row)) continue;
            fetch_warp(d, stage_x + (first_row + row) * row_bytes, slot_x(d, slot) + row * row_bytes, row_bytes, src,
                       lane);
            fetch_warp(d, stage_sf + (first_row + row) * sf_floats, slot_x_sf(d, slot) + row * sf_floats,
                       sf_floats * sizeof(float), src, lane);
        }
        fetch_done(d, src);  // every row's bytes are in the stage, visible to the block
        // The scales of the rows fetched, checked in place (the same warp per row as above).
        for (u64 row = lo + threadIdx.x / kWarp; row < hi; row += warps) {
            if (!mine(row)) continue;
            float* sf = stage_sf + (first_row + row) * sf_floats;
            for (u64 i = lane; i < sf_floats; i += kWarp) sf[i] = checked_scale(d, src, slot, row, i, sf[i]);
        }
        __syncthreads();
        if (first_thread) timeline::record(trace, trace_capacity, timeline::kPulled, src, chunk_of[src]);
        return true;
    };
    auto acked = [&](u64 src, u64) {
        if (first_thread) timeline::record(trace, trace_capacity, timeline::kAcked, src, chunk_of[src]);
    };
    // The kNoDeferredAck mutant acknowledges last chunks here too: the owner's drain then returns before
    // the combine rows land (caught by tests/gpu/test_moe_layer.py).
    u64* hold = kMutant == Mutant::kNoDeferredAck ? nullptr : reinterpret_cast<u64*>(held);
    consume_invocation(d, current_epoch(d), arrivals, hold, visit, acked);
}

// One block per source rank: acknowledge the chunk moe_pull held for it, if any, once every block of
// moe_combine_push (moe_experts.cu) arrived on `pushed` (push_blocks of them). Each arrival follows that
// block's release of its combine stores; thread 0's relaxed read of the full count, then ack_chunk's
// system-scope fence, acquire them all, and the same fence is the ack's release, cumulative over them:
// once its owner sees this ack, every combine row this rank computed for it has landed. Stream order
// has the push complete already; the count makes the edge explicit instead of resting on kernel
// completion for another GPU's memory (docs/PROTOCOL.md, "The MoE layer on the ring").
extern "C" __global__ void moe_ack_held(const RingDesc* desc, const unsigned long long* held,
                                        const unsigned long long* pushed, long long push_blocks,
                                        CHUNKRING_NULLABLE long long* trace, long long trace_capacity) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 src = blockIdx.x, seq = held[src];
    if (seq == kNoHeldChunk) return;  // nothing pulled from src (its wait failed and was recorded)
    bool all_pushed = true;
    if (threadIdx.x == 0) {
        const u64 want = static_cast<u64>(push_blocks);
        const auto* count = reinterpret_cast<const u64*>(pushed);
        // NOTES: relaxed polling; ack_chunk's fence after it is the acquire.
        all_pushed = spin_until(d, Site::kWaitPushed, d.my_pe, 0, want, [&](u64& observed) {
            observed = ptx::ld_relaxed_sys(count);
            return observed == want ? 1 : 0;
        });
    }
    if (!block_agree(all_pushed)) return;
    // The slot is still ours until the ack: its meta names the chunk for the trace (fetched only when
    // traced: a get to an RMA peer costs a round trip).
    ChunkMeta meta{};
    if (trace != nullptr && !chunk_meta(d, src, slot_of(seq, d.num_slots), meta)) return;
    if (ack_chunk(d, current_epoch(d), src, seq) && threadIdx.x == 0)
        timeline::record(trace, trace_capacity, timeline::kAcked, static_cast<long long>(src),
                         static_cast<long long>(meta.token_base / d.tokens_per_slot));
}

// One block: wait until every destination acknowledged every chunk this rank published, so every
// combine row for this rank's tokens has landed (see moe_ack_held) and its combine buffer can be reduced.
extern "C" __global__ void moe_drain(const RingDesc* desc) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    drain(d, current_epoch(d));
}

// A timeline record at this point of its stream (the layer's host-side events: a chunk's producers
// begin, its publish returned, the experts begin and end, the combine is pushed, ...). One thread
// records, whatever the launch shape.
extern "C" __global__ void moe_trace_mark(CHUNKRING_NULLABLE long long* trace, long long trace_capacity,
                                          long long event, long long src, long long chunk) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
        timeline::record(trace, trace_capacity, static_cast<timeline::Event>(event), src, chunk);
}
