// Kernels of the MoE layer (runtime/chunkring/moe/layer.py) that use the ring. The expert work between the pull
// and the held acknowledgement is moe_experts.cu's (plan, SwiGLU, combine push) and the GEMM engine's.
//
// One call at a destination rank, on its consumer stream:
//   moe_call_reset     the call's consumer words: the stage's routing and held seqs, the push count
//   moe_local_route,   (a one-rank layer's batch-ready call of routed rows, in place of the reset, the publish, the
//   moe_local_scatter  pull, the acknowledgements, the drain and the plan's count and scatter) the call's routing
//                      into the stage and its rows straight into the plan
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
#include "chunkring/protocol/publish.cuh"
#include "chunkring/protocol/ring.cuh"
#include "chunkring/protocol/validate.cuh"
#include "chunkring/ptx/dependent_launch.cuh"
#include "chunkring/util/copy.cuh"
#include "chunkring/util/kernel_params.cuh"
#include "chunkring/moe/blocks.cuh"
#include "chunkring/moe/descriptors.cuh"
#include "chunkring/moe/kernel_args.cuh"
#include "chunkring/moe/plan.cuh"
#include "chunkring/moe/timeline.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
namespace timeline = chunkring::moe::timeline;
using chunkring::layout::address;
using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::moe::PoolDesc;
using chunkring::moe::LocalRouteArgs;
using chunkring::moe::LocalScatterArgs;
using chunkring::moe::StageDesc;

namespace {

constexpr u32 kWarp = 32;
// held[src] before a call's pull: no chunk of src is waiting for its acknowledgement.
constexpr u64 kNoHeldChunk = ~0ull;

// Where a pull defers each source's last acknowledgement (consume_invocation's `deferred`). The
// kNoDeferredAck mutant acknowledges last chunks at the pull too: the owner's drain then returns before the
// combine rows land (caught by tests/gpu/test_moe_layer.py).
__device__ __forceinline__ u64* held_acks(unsigned long long* held) {
    return kMutant == Mutant::kNoDeferredAck ? nullptr : reinterpret_cast<u64*>(held);
}

// Rows [lo, hi) of src's chunk in `slot`: routing and weights fetched into the stage rows that start at
// idx and w (the chunk's row 0), the routing checked in place (fetch_block returns with the bytes visible
// to the whole block). The caller syncs the block before other warps read idx back.
__device__ void pull_routing(const RingDesc& d, u64 src, u64 slot, int* idx, float* w, u64 lo, u64 hi) {
    const u64 K = d.topk;
    fetch_block(d, idx + lo * K, slot_topk_idx(d, slot) + lo * K, (hi - lo) * K * sizeof(int), src);
    fetch_block(d, w + lo * K, slot_topk_weights(d, slot) + lo * K, (hi - lo) * K * sizeof(float), src);
    for (u64 i = lo * K + threadIdx.x; i < hi * K; i += blockDim.x)
        idx[i] = checked_expert(d, src, slot, i / K, i % K, idx[i]);
}

// Whether a row's K choices name an expert in [lo, hi): a lane per choice, the warp's verdict (every lane of the
// warp calls it).
__device__ __forceinline__ bool routed_here(const int* choices, u64 K, long long lo, long long hi, u32 lane) {
    bool any = false;
    for (u64 k = lane; k < K; k += kWarp) any |= choices[k] >= lo && choices[k] < hi;
    return __any_sync(0xffffffffu, any);
}

// consume_invocation's `acked` hook of a traced pull: one record per acknowledgement, by the grid's first thread.
struct TraceAcked {
    long long* trace;
    long long capacity;
    const long long* chunk_of;  // per source: the chunk being pulled
    bool first_thread;
    __device__ void operator()(u64 src, u64) const {
        if (first_thread) timeline::record(trace, capacity, timeline::kAcked, src, chunk_of[src]);
    }
};

}  // namespace

// A call's consumer words, in one launch before its pull, whatever an earlier call (a failed one too) left: the
// stage's routing idx [W, N, K] to -1 (planned nowhere: a row no chunk brings is computed by no expert and read by
// no reduction), its held [W] to kNoHeldChunk and the combine push's count to 0 (every call adds to it). Not the
// pull's arrival counts: a call leaves them at zero (each chunk's last arrival zeroes its count), and only a
// failed call, which MoELayer.reset follows, can leave one short. Plain stores, any grid: the pull, the push
// and moe_ack_held come after it in stream order.
extern "C" __global__ void moe_call_reset(const StageDesc* stage, unsigned long long* pushed) {
    const StageDesc& s = *stage;
    moe::require_descriptor(s);
    auto* idx = address<int>(s.idx);
    auto* held = address<unsigned long long>(s.held);
    const u64 choices = s.sources * s.token_capacity * s.topk;
    const u64 first = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
    const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
    for (u64 i = first; i < choices; i += stride) idx[i] = -1;
    for (u64 i = first; i < s.sources; i += stride) held[i] = kNoHeldChunk;
    if (first == 0) *pushed = 0;
}

// One call's pull, any grid: consume_invocation over every source; each block copies its share of every
// chunk's rows into the stage at [src, token_base + row] - routing (checked, protocol/validate.cuh) and
// weights of every row, the payload of rows with a choice in [expert_lo, expert_hi). Other stage rows
// keep what the host filled (topk_idx -1: planned nowhere) or stale bytes the plan never reads.
// Every chunk but a source's last is acknowledged as soon as every block copied it: nothing the call
// reads later is slot-resident (the RFC's early input_consumed). The last is held (held[src] = its
// seq) for moe_ack_held.
//   arrivals [W * S] (null for one block): zero between calls (each chunk's last arrival zeroes its count;
//            after a failed call MoELayer.reset)
//   stage: layout/moe_desc.cuh (its idx -1 and its held [W] kNoHeldChunk, by moe_call_reset)
//   trace (nullable): timeline.cuh's buffer of trace_capacity records (observed, pulled, acked)
extern "C" __global__ void moe_pull(const RingDesc* desc, CHUNKRING_NULLABLE unsigned* arrivals, const StageDesc* stage,
                                    CHUNKRING_NULLABLE long long* trace, long long trace_capacity) {
    const RingDesc& d = *desc;
    const StageDesc& s = *stage;
    if (!check_descriptor(d) || !moe::check_stage(d, s)) return;
    const u64 N = s.token_capacity, T = d.tokens_per_slot, K = d.topk;
    const long long expert_lo = static_cast<long long>(s.expert_lo), expert_hi = static_cast<long long>(s.expert_hi);
    auto* stage_x = address<unsigned char>(s.x);
    auto* stage_sf = address<float>(s.sf);
    auto* stage_idx = address<int>(s.idx);
    auto* stage_w = address<float>(s.w);
    const u64 row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats;
    const bool first_thread = threadIdx.x == 0 && blockIdx.x == 0;  // reports and traces for the grid
    __shared__ long long chunk_of[kMaxWorldSize];  // per source: the chunk being pulled, for the trace
    auto visit = [&](u64 src, u64, u64 slot, const ChunkMeta& meta) {
        // Every read of the slot below is a fetch (protocol/transport.cuh): loads through nvshmem_ptr or
        // NVSHMEM gets, as the descriptor says for src; all of them complete before this visit returns,
        // so before the chunk's acknowledgement.
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
        pull_routing(d, src, slot, idx, stage_w + first_row * K, lo, hi);
        __syncthreads();  // idx is read back below by other warps of the block

        // A warp per row: the row's K choices decide (one lane each) whether this rank needs its payload.
        const u32 lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
        auto mine = [&](u64 row) { return routed_here(idx + row * K, K, expert_lo, expert_hi, lane); };
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
    consume_invocation(d, current_epoch(d), whole_grid(arrivals), held_acks(address<unsigned long long>(s.held)),
                       visit, TraceAcked{trace, trace_capacity, chunk_of, first_thread});
}

// A one-rank layer's batch-ready call of routed rows (docs/PROTOCOL.md, "One rank") is two launches on its consumer
// stream, where the ring's call takes a reset, a publish, a pull, a plan count and a scatter: what those leave for
// the expert work and the reduction, from the caller's tensors. Nothing crosses a GPU, so stream order (and the
// second's dependent-launch wait) is the only ordering. Both take the call's extent from the same inputs
// (chunk_extent: a device count may cut it short) and report what the publish and the pull would report (source
// my_pe, slot 0: the batch-ready ring's one slot) in the ring's status words, once.
struct LocalCall {
    u64 n;     // the call's rows below its extent, checked against the stage (checked_chunk_rows)
    bool ok;   // the ring's and the stage's descriptors agree: otherwise nothing is staged or planned
};

__device__ __forceinline__ LocalCall local_call(const RingDesc& d, const StageDesc& s, int n_tokens,
                                                const int* valid_tokens, bool report) {
    if (!check_descriptor(d) || !moe::check_stage(d, s)) return {0, false};
    const ChunkExtent e = chunk_extent(d, n_tokens, 0, 1, valid_tokens, n_tokens, report);
    return {checked_chunk_rows(d, d.my_pe, 0, 0, e.n, s.token_capacity, report && threadIdx.x == 0), true};
}

// The first, one block: the call's routing, checked (checked_expert, reported), into the stage rows of source my_pe
// that the reduction reads - the routing and weights of each token below the extent, -1 (planned nowhere) for the
// rest of the call's rows - and the whole plan but its payload: counts and group_end [E_local]; each local choice's
// plan row (its rank among its expert's choices, from a shared-memory counter, past its group's offset) in own_row
// [t * K + k], with the choice's source, token, k and weight at that row; -1 in own_row for every other choice of the
// call's rows and in row_src for each group's padding rows. The plan's rows past the last group are the scatter's.
// One block sees every choice, so no reset launch, no count launch and no global cursor come before it.
//   stage: layout/moe_desc.cuh; of it only idx and w of source my_pe, tokens [0, min(n_tokens, N)), are written
extern "C" __global__ void moe_local_route(const __grid_constant__ LocalRouteArgs args) {
    ptx::release_dependents();  // moe_local_scatter waits for this grid's end before it reads what this one writes
    require_args(args);
    const RingDesc& d = *arg<const RingDesc*>(args.desc);
    const StageDesc& s = *arg<const StageDesc*>(args.stage);
    moe::require_descriptor(s);
    const int n_tokens = arg<int>(args.n_tokens);
    const LocalCall call = local_call(d, s, n_tokens, arg<const int*>(args.valid_tokens), true);
    const int expert_lo = static_cast<int>(s.expert_lo), num_local = static_cast<int>(s.expert_hi - s.expert_lo);
    extern __shared__ unsigned shared[];  // totals [E_local], then the groups' offsets [E_local + 1]
    unsigned* totals = shared;
    unsigned* offsets = shared + num_local;
    for (int e = threadIdx.x; e < num_local; e += blockDim.x) totals[e] = 0;
    __syncthreads();
    const u64 src = d.my_pe, K = s.topk;
    const u64 choices = call.ok ? min(static_cast<u64>(n_tokens), static_cast<u64>(s.token_capacity)) * K : 0;
    int* idx = address<int>(s.idx) + src * s.token_capacity * K;
    float* w = address<float>(s.w) + src * s.token_capacity * K;
    const int* topk_idx = arg<const int*>(args.topk_idx);
    const float* topk_weights = arg<const float*>(args.topk_weights);
    auto* own_row = arg<int*>(args.own_row);
    // Each thread keeps to the same choices i in both passes: a choice's rank, parked in own_row[i] by its thread,
    // is read back by that thread only, so no fence is needed between them.
    for (u64 i = threadIdx.x; i < choices; i += blockDim.x) {
        int expert = -1;
        if (i < call.n * K) {
            expert = checked_expert(d, src, 0, i / K, i % K, topk_idx[i]);
            w[i] = topk_weights[i];
        }
        idx[i] = expert;
        const bool local = expert >= expert_lo && expert - expert_lo < num_local;
        own_row[i] = local ? static_cast<int>(atomicAdd(totals + (expert - expert_lo), 1u)) : -1;
    }
    __syncthreads();
    moe::group_offsets(totals, num_local, arg<int>(args.block_m), offsets);
    auto* row_src = arg<int*>(args.row_src);
    auto* row_token = arg<int*>(args.row_token);
    auto* row_k = arg<int*>(args.row_k);
    auto* row_weight = arg<float*>(args.row_weight);
    for (u64 i = threadIdx.x; i < choices; i += blockDim.x) {
        const int rank = own_row[i];
        if (rank < 0) continue;
        const unsigned p = offsets[idx[i] - expert_lo] + static_cast<unsigned>(rank);
        own_row[i] = static_cast<int>(p);
        row_src[p] = static_cast<int>(src);
        row_token[p] = static_cast<int>(i / K);
        row_k[p] = static_cast<int>(i % K);
        row_weight[p] = w[i];
    }
    auto* counts = arg<unsigned*>(args.counts);
    auto* group_end = arg<int*>(args.group_end);
    const u32 lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
    for (int e = threadIdx.x / kWarp; e < num_local; e += warps) {  // a warp per group: its padding rows
        const unsigned end = offsets[e] + totals[e];
        for (unsigned r = end + lane; r < offsets[e + 1]; r += kWarp) row_src[r] = -1;
        if (lane == 0) {
            counts[e] = totals[e];
            group_end[e] = static_cast<int>(end);
        }
    }
}

// The second, any grid (a dependent launch): the plan's rows past the last group (source -1, a grid-stride share of
// plan_rows), then each local choice's payload - a warp per choice of the call's rows below the extent, a
// contiguous share of them per block - copied from the caller's tensors into the plan row moe_local_route gave it,
// its scales checked on the way (reported by the warp of the row's first local choice only).
//   rows [plan_rows, row_bytes], rows_sf (scale j of row p at j * sf_stride + p), row_src [plan_rows]: the plan's
//   group_end, own_row: moe_local_route's
extern "C" __global__ void moe_local_scatter(const __grid_constant__ LocalScatterArgs args) {
    require_args(args);
    const RingDesc& d = *arg<const RingDesc*>(args.desc);
    const StageDesc& s = *arg<const StageDesc*>(args.stage);
    moe::require_descriptor(s);
    // The call's extent reads only what came before moe_local_route (the descriptors, the caller's device count),
    // so it is taken before the wait for what that grid writes.
    const LocalCall call = local_call(d, s, arg<int>(args.n_tokens), arg<const int*>(args.valid_tokens), false);
    ptx::wait_prior_grid();
    ptx::release_dependents();  // the expert work may start: what it reads of this grid's, it reads after its own wait
    const u64 used = moe::rows_in_use(arg<const int*>(args.group_end), static_cast<int>(s.expert_hi - s.expert_lo),
                                      arg<int>(args.block_m));
    auto* row_src = arg<int*>(args.row_src);
    const u64 plan_rows = arg<long long>(args.plan_rows);
    for (u64 r = used + static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; r < plan_rows;
         r += static_cast<u64>(gridDim.x) * blockDim.x)
        row_src[r] = -1;
    if (!call.ok) return;
    const u64 src = d.my_pe, K = s.topk, choices = call.n * K;
    const u64 lo = choices * blockIdx.x / gridDim.x, hi = choices * (blockIdx.x + 1) / gridDim.x;
    const auto* x = arg<const unsigned char*>(args.x);
    const auto* x_sf = arg<const float*>(args.x_sf);  // null for bf16 rows, which carry no scales
    const auto* own_row = arg<const int*>(args.own_row);
    auto* rows = arg<unsigned char*>(args.rows);
    auto* rows_sf = arg<float*>(args.rows_sf);
    const u64 sf_stride = arg<long long>(args.sf_stride);
    const u64 row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats;
    const u32 lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
    for (u64 i = lo + threadIdx.x / kWarp; i < hi; i += warps) {
        const int p = own_row[i];
        if (p < 0) continue;
        const u64 row = i / K, k = i % K;
        bool earlier = false;  // a local choice of this row before k: its warp reports the row's scales
        for (u64 k0 = 0; k0 < k; k0 += kWarp)
            earlier |= __any_sync(0xffffffffu, k0 + lane < k && own_row[row * K + k0 + lane] >= 0);
        util::warp_copy16(rows + p * row_bytes, x + row * row_bytes, row_bytes, lane);
        for (u64 j = lane; j < sf_floats; j += kWarp)
            rows_sf[j * sf_stride + p] = checked_scale(d, src, 0, row, j, x_sf[row * sf_floats + j], !earlier);
    }
}

// moe_pull with incremental expert blocks (docs/PROTOCOL.md, "Incremental expert blocks"): the same walk
// over every source's chunks, the same checks and acknowledgements, but each (token, k) choice of a local
// expert goes straight into its expert's block of the pool (moe/blocks.cuh) instead of the stage: per
// chunk share, (1) a warp per row: lane 0 reserves the row's choices in k order (RESERVE, ALLOCATE or
// WAIT), the warp starts fetching the row's payload into each reserved pool row; fetch_done; (2) a warp
// per row again: the scales checked in place, source, token, k and weight stored, then lane 0 lands each
// choice (LAND, SEAL A FULL BLOCK). After its last source each block arrives on `ended`; the last one
// seals the partial blocks. The waves (moe_experts.cu) run concurrently, on another stream.
//   stage: its idx / w [W, N, K] take the routing, fetched and checked as moe_pull does (scratch here), its
//          held the held acks; its rows are not written
//   pool (layout/moe_desc.cuh): words, moe/blocks.cuh's (zeroed by the host before the launch), E of them
//          expert_hi - expert_lo; pos [W, N, K], each choice's pool row between the two passes (kNoRow: none);
//          x [P * bm, x_row_bytes], sf [P * bm, x_sf_row_floats], src / token / k, weight [P * bm]
extern "C" __global__ void moe_pull_blocks(const RingDesc* desc, CHUNKRING_NULLABLE unsigned* arrivals,
                                           const StageDesc* stage, const PoolDesc* pool_desc,
                                           CHUNKRING_NULLABLE long long* trace, long long trace_capacity) {
    namespace blk = chunkring::moe::blocks;
    const RingDesc& d = *desc;
    const StageDesc& s = *stage;
    const PoolDesc& p = *pool_desc;
    if (!check_descriptor(d) || !moe::check_stage(d, s) || !moe::check_pool(d, p, &s)) return;
    const blk::Pool pool = moe::pool_of(p);
    const long long expert_lo = static_cast<long long>(s.expert_lo), expert_hi = static_cast<long long>(s.expert_hi);
    auto* stage_idx = address<int>(s.idx);
    auto* stage_w = address<float>(s.w);
    auto* pos = address<unsigned>(p.pos);
    auto* pool_x = address<unsigned char>(p.x);
    auto* pool_sf = address<float>(p.sf);
    auto* pool_src = address<int>(p.src);
    auto* pool_token = address<int>(p.token);
    auto* pool_k = address<int>(p.k);
    auto* pool_w = address<float>(p.weight);
    const u64 N = s.token_capacity, T = d.tokens_per_slot, K = d.topk;
    const u64 row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats;
    const bool first_thread = threadIdx.x == 0 && blockIdx.x == 0;
    const u32 lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
    __shared__ long long chunk_of[kMaxWorldSize];
    // Per source: the end of its last non-empty chunk of this call. Every block sees the same chunks, so
    // every block masks the same ones; only thread 0 writes it, after a barrier that follows every read.
    __shared__ u64 next_base[kMaxWorldSize];
    for (u64 src = threadIdx.x; src < d.world_size; src += blockDim.x) next_base[src] = 0;
    __syncthreads();
    auto visit = [&](u64 src, u64, u64 slot, const ChunkMeta& meta) {
        const u64 base = meta.token_base;
        const u64 n = checked_chunk_order(d, src, slot, base,
                                          checked_chunk_rows(d, src, slot, base, meta.num_tokens, N, first_thread),
                                          next_base[src], first_thread);
        if (first_thread) {
            chunk_of[src] = n ? static_cast<long long>(base / T) : 0;
            timeline::record(trace, trace_capacity, timeline::kObserved, src, chunk_of[src]);
        }
        const u64 lo = n * blockIdx.x / gridDim.x, hi = n * (blockIdx.x + 1) / gridDim.x;
        const u64 first_row = src * N + (n ? base : 0);
        int* idx = stage_idx + first_row * K;
        unsigned* at = pos + first_row * K;
        pull_routing(d, src, slot, idx, stage_w + first_row * K, lo, hi);
        __syncthreads();  // idx is read back below by other warps of the block; every read of next_base done
        if (threadIdx.x == 0 && n) next_base[src] = base + n;

        // Pass 1: reserve, then start the payload fetches into every reserved row.
        for (u64 row = lo + threadIdx.x / kWarp; row < hi; row += warps) {
            if (lane == 0) {
                // One lane, the row's choices in k order: an allocation never waits behind this lane's own
                // wait (PROTOCOL.md step 2).
                for (u64 k = 0; k < K; ++k) {
                    const int e = idx[row * K + k];
                    at[row * K + k] = e >= expert_lo && e < expert_hi
                                          ? blk::reserve_row(d, pool, static_cast<u32>(e - expert_lo))
                                          : blk::kNoRow;
                }
            }
            __syncwarp();  // lane 0's positions, for every lane of the warp
            for (u64 k = 0; k < K; ++k) {
                const u32 p = at[row * K + k];
                if (p == blk::kNoRow) continue;
                fetch_warp(d, pool_x + p * row_bytes, slot_x(d, slot) + row * row_bytes, row_bytes, src, lane);
                fetch_warp(d, pool_sf + p * sf_floats, slot_x_sf(d, slot) + row * sf_floats,
                           sf_floats * sizeof(float), src, lane);
            }
        }
        fetch_done(d, src);  // every reserved row's bytes are in the pool, visible to the block
        // Pass 2 (the same warp per row): STORE the rest of each row, then LAND it.
        for (u64 row = lo + threadIdx.x / kWarp; row < hi; row += warps) {
            for (u64 k = 0; k < K; ++k) {
                const u32 p = at[row * K + k];
                if (p == blk::kNoRow) continue;
                float* sf = pool_sf + p * sf_floats;
                for (u64 i = lane; i < sf_floats; i += kWarp) sf[i] = checked_scale(d, src, slot, row, i, sf[i]);
                if (lane == 0) {
                    pool_src[p] = static_cast<int>(src);
                    pool_token[p] = static_cast<int>(base + row);
                    pool_k[p] = static_cast<int>(k);
                    pool_w[p] = stage_w[(first_row + row) * K + k];
                }
                __syncwarp();  // every lane's stores of the row before lane 0's release (LAND)
                if (lane == 0) blk::land_row(pool, p);
            }
        }
        __syncthreads();
        if (first_thread) timeline::record(trace, trace_capacity, timeline::kPulled, src, chunk_of[src]);
        return true;
    };

    // A block whose walk failed (recorded) never arrives on `ended`: the waves' last claim then waits,
    // and stops at this rank's error (spin_until), so no partial block is sealed with rows missing.
    if (!consume_invocation(d, current_epoch(d), whole_grid(arrivals), held_acks(address<unsigned long long>(s.held)),
                            visit, TraceAcked{trace, trace_capacity, chunk_of, first_thread}))
        return;
    __syncthreads();  // every LAND of this block before thread 0's release
    if (threadIdx.x == 0) blk::end_of_streams(d, pool);
}

// One block per source rank: acknowledge the chunk moe_pull held for it, if any, once every block of
// moe_combine_push (moe_experts.cu) arrived on `pushed` (push_blocks of them). Each arrival follows that
// block's release of its combine stores; thread 0's relaxed read of the full count, then ack_chunk's
// system-scope fence, acquire them all, and the same fence is the ack's release, cumulative over them:
// once its owner sees this ack, every combine row this rank computed for it has landed. Stream order
// has the push complete already; the count makes the edge explicit instead of resting on kernel
// completion for another GPU's memory (docs/PROTOCOL.md, "The MoE layer on the ring"). A dependent launch: it
// waits for the kernel ahead of it (the push, which lets it start early) before anything else.
extern "C" __global__ void moe_ack_held(const RingDesc* desc, const StageDesc* stage,
                                        const unsigned long long* pushed, long long push_blocks,
                                        CHUNKRING_NULLABLE long long* trace, long long trace_capacity) {
    ptx::wait_prior_grid();
    const RingDesc& d = *desc;
    if (!check_descriptor(d) || !moe::check_stage(d, *stage)) return;
    const u64 src = blockIdx.x, seq = address<const u64>(stage->held)[src];
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
