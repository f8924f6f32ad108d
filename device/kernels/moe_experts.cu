// The MoE consumer's expert work at one destination rank (runtime/chunkring/moe/_engine/experts.py drives it), after
// moe_pull (moe_stream.cu) staged every source's rows at their token index:
//
//   moe_plan_reset     a plan with nothing planned: its counters 0, every row's source -1
//   moe_plan_count     count the staged (source, token, k) choices of each local expert
//   moe_plan_scatter   give each choice a row of its expert's group (groups padded to block_m rows) and
//                      copy its payload there: the FP8 row and its 1x128 scales in the GEMM's layout
//                      (or the bf16 row), its source, token, k, weight; and each group's end
//   (GEMM engine)      L1: gate_up = rows @ w13[e]^T per group
//   moe_swiglu_fp8     act = silu(gate) * up, quantised to FP8 with one fp32 scale per 1x128 (FP8 path)
//   moe_swiglu_bf16    act = silu(gate) * up in bf16 (bf16 path)
//   (GEMM engine)      L2: out = act @ w2[e]^T per group
//   moe_combine_push   each real row * its top-k weight, as bf16, into its source's combine buffer at
//                      token * K + k - but the rows of this rank's own tokens, which stay where L2 wrote them
// and at each source, once its drain saw every destination's ack (moe_stream.cu):
//   moe_combine_reduce out[t] = the sum over its routed choices k of its combine rows t * K + k, an own
//                      choice's row read in place (its L2 row times its weight, rounded as the push rounds)
//
// Dependent launches (ptx/dependent_launch.cuh): moe_plan_scatter, moe_combine_push and moe_combine_reduce are
// launched with pdl, so each starts as soon as the kernel ahead of it let it, and waits for that kernel's
// completion (wait_prior_grid) before its first global memory access. moe_plan_count (at its start: it is not a
// dependent launch), moe_plan_scatter and moe_combine_push (as soon as their wait returns), which never spin, let
// theirs start early (release_dependents). moe_drain, ahead of the reduction, spins: it never does, so the
// reduction's blocks are placed only once it has ended.
//
// Every kernel is a fixed grid that loops over what the call brought: rows past the last group and
// padding rows cost a bounds check, not a pass. A row's place inside its group comes from an atomic
// cursor, so it varies between runs; nothing depends on it: the GEMMs compute each row from that row
// alone, and the combine writes each (token, k) to its own place, so outputs are bitwise reproducible.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cuda/std/cstdint>

#include "chunkring/moe/blocks.cuh"
#include "chunkring/moe/descriptors.cuh"
#include "chunkring/moe/fp8.cuh"
#include "chunkring/moe/kernel_args.cuh"
#include "chunkring/moe/plan.cuh"
#include "chunkring/protocol/mutants.cuh"
#include "chunkring/ptx/dependent_launch.cuh"
#include "chunkring/ptx/ordering.cuh"
#include "chunkring/protocol/transport.cuh"
#include "chunkring/util/copy.cuh"
#include "chunkring/util/kernel_params.cuh"

namespace {

namespace moe = chunkring::moe;
namespace util = chunkring::util;
namespace ptx = chunkring::ptx;
using chunkring::protocol::kMutant;
using chunkring::protocol::Mutant;
using chunkring::layout::RingDesc;
using chunkring::layout::address;
using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::moe::CombinePushArgs;
using chunkring::moe::CombineReduceArgs;
using chunkring::moe::PlanScatterArgs;
using chunkring::moe::PoolDesc;
using chunkring::moe::StageDesc;
using chunkring::moe::WaveGatherArgs;
using chunkring::moe::group_offsets;
using chunkring::protocol::Site;
using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

constexpr u32 kWarp = 32;
constexpr u32 kScaleBlock = 128;    // channels per activation scale (DeepSeek's 1x128 recipe)
constexpr u32 kReduceInFlight = 4;  // moe_combine_reduce: combine rows loaded before they are added

// A row element times its choice's top-k weight, in fp32, rounded to bf16: what a combine row holds - written so
// by moe_combine_push, or computed so by moe_combine_reduce for an own row the push left in place, so that the
// sum over k has the same bits whichever rank computed a row.
__device__ __forceinline__ __nv_bfloat16 weighted(__nv_bfloat16 v, float weight) {
    return __float2bfloat16_rn(__bfloat162float(v) * weight);
}

}  // namespace

// A plan with nothing planned, in one launch: counters [counter_words] (counts, group ends and the scatter's
// cursors, E_local each) 0, row_src [rows] -1 (every row padding until moe_plan_scatter or moe_wave_gather fills
// it) and own_row [own_choices] -1 (no own choice planned). Plain stores, any grid: the plan's kernels, and the
// reduction that reads own_row, come after it in stream order.
extern "C" __global__ void moe_plan_reset(unsigned* counters, long long counter_words, int* row_src, long long rows,
                                          int* own_row, long long own_choices) {
    const u64 first = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
    const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
    for (u64 i = first; i < static_cast<u64>(counter_words); i += stride) counters[i] = 0;
    for (u64 i = first; i < static_cast<u64>(rows); i += stride) row_src[i] = -1;
    for (u64 i = first; i < static_cast<u64>(own_choices); i += stride) own_row[i] = -1;
}

// counts [E_local] (zeroed by moe_plan_reset) += the choices in the stage's idx [W, N, K] of experts
// [expert_lo, expert_hi). Out-of-range values were already masked to -1 by moe_pull.
extern "C" __global__ void moe_plan_count(const StageDesc* stage, unsigned* counts) {
    ptx::release_dependents();
    const StageDesc& s = *stage;
    chunkring::moe::require_descriptor(s);
    const int* stage_idx = address<const int>(s.idx);
    const u64 choices = s.sources * s.token_capacity * s.topk;
    const int expert_lo = static_cast<int>(s.expert_lo), num_local = static_cast<int>(s.expert_hi - s.expert_lo);
    for (u64 i = blockIdx.x * blockDim.x + threadIdx.x; i < choices; i += gridDim.x * blockDim.x) {
        const int e = stage_idx[i] - expert_lo;
        if (e >= 0 && e < num_local) atomicAdd(counts + e, 1u);
    }
}

// Each warp looks at 32 choices of the stage's idx [W, N, K] at a time, one per lane, `warps` apart (lane l of
// warp w in pass i: choice (32 i + l) * warps + w); each choice of a local expert takes the next row of its
// group (cursors [E_local], zeroed by moe_plan_reset) and the warp copies its payload there, one row after another.
// The stride spreads a small call's rows - a token's k choices, consecutive tokens - over as many warps as it
// has rows, so their copies run side by side instead of 32 round trips in one warp.
//   stage: x [W, N, row_bytes], sf [W, N, sf_per_row] fp32 (FP8 payload; sf_per_row 0 for bf16), idx, w
//   rows [P, row_bytes]         rows_sf: the GEMM's scale layout, scale j of row p at j * sf_stride + p
//   row_src [P] int32: source rank, -1 on padding rows (prefilled by moe_plan_reset)
//   row_token / row_k [P] int32, row_weight [P] fp32 (padding rows: unwritten)
//   group_end [E_local] int32: offset(e) + counts[e], the real rows' end of each group - DeepGEMM's
//   "psum" grouped layout, with which its GEMMs visit only each expert's own row blocks
//   own_row [N * K] int32: for each choice of source own_rank (this rank's own tokens), its row p at token * K + k
//   (-1 elsewhere, prefilled by moe_plan_reset): where the reduction finds it, since the push skips those rows
//   (block_m: the groups' row multiple; counts [E_local] from moe_plan_count)
extern "C" __global__ void moe_plan_scatter(const __grid_constant__ PlanScatterArgs args) {
    ptx::wait_prior_grid();
    ptx::release_dependents();
    require_args(args);
    const auto* stage = arg<const StageDesc*>(args.stage);
    const int block_m = arg<int>(args.block_m);
    const auto* counts = arg<const unsigned*>(args.counts);
    auto* cursors = arg<unsigned*>(args.cursors);
    auto* rows = arg<unsigned char*>(args.rows);
    auto* rows_sf = arg<float*>(args.rows_sf);
    const long long sf_stride = arg<long long>(args.sf_stride);
    auto* row_src = arg<int*>(args.row_src);
    auto* row_token = arg<int*>(args.row_token);
    auto* row_k = arg<int*>(args.row_k);
    auto* row_weight = arg<float*>(args.row_weight);
    auto* group_end = arg<int*>(args.group_end);
    const int own_rank = arg<int>(args.own_rank);
    auto* own_row = arg<int*>(args.own_row);
    const StageDesc& s = *stage;
    chunkring::moe::require_descriptor(s);
    const auto* stage_x = address<const unsigned char>(s.x);
    const auto* stage_sf = address<const float>(s.sf);
    const auto* stage_idx = address<const int>(s.idx);
    const auto* stage_w = address<const float>(s.w);
    const u64 row_bytes = s.row_bytes, sf_per_row = s.sf_per_row, choices = s.sources * s.token_capacity * s.topk;
    const int expert_lo = static_cast<int>(s.expert_lo), num_local = static_cast<int>(s.expert_hi - s.expert_lo);
    extern __shared__ unsigned offsets[];  // E_local + 1
    group_offsets(counts, num_local, block_m, offsets);
    if (blockIdx.x == 0)
        for (int e = threadIdx.x; e < num_local; e += blockDim.x) group_end[e] = offsets[e] + counts[e];
    const u32 lane = threadIdx.x % kWarp;
    const u64 warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp, warps = gridDim.x * blockDim.x / kWarp;
    const u64 N = s.token_capacity, K = s.topk;
    for (u64 pass = 0; pass * kWarp * warps + warp < choices; ++pass) {
        const u64 mine_choice = (pass * kWarp + lane) * warps + warp;
        int e = -1;
        unsigned row = 0;
        if (mine_choice < choices) {
            e = stage_idx[mine_choice] - expert_lo;
            if (e >= 0 && e < num_local) {
                row = offsets[e] + atomicAdd(cursors + e, 1u);
            } else {
                e = -1;
            }
        }
        unsigned todo = __ballot_sync(0xffffffffu, e >= 0);
        while (todo) {
            const int from = __ffs(todo) - 1;
            todo &= todo - 1;
            const u64 choice = (pass * kWarp + from) * warps + warp;
            const u64 p = __shfl_sync(0xffffffffu, row, from);
            const u64 src = choice / (N * K), token = choice / K % N;
            const u64 stage_row = src * N + token;
            if (lane == 0) {
                row_src[p] = static_cast<int>(src);
                row_token[p] = static_cast<int>(token);
                row_k[p] = static_cast<int>(choice % K);
                row_weight[p] = stage_w[choice];
                if (src == static_cast<u64>(own_rank)) own_row[choice % (N * K)] = static_cast<int>(p);
            }
            util::warp_copy16(rows + p * row_bytes, stage_x + stage_row * row_bytes, row_bytes, lane);
            for (u64 j = lane; j < sf_per_row; j += kWarp) rows_sf[j * sf_stride + p] = stage_sf[stage_row * sf_per_row + j];
        }
    }
}

// FP8 path: act [P, I] e4m3 and act_sf (scale j of row p at j * sf_stride + p) from gate_up [P, 2I]
// bf16 (gate columns first): a warp per (row, 128-column block) of the rows in use, padding rows
// skipped. Each block's absmax maps to 448 (a zero block gets scale 1), as the producers' quantisation.
extern "C" __global__ void moe_swiglu_fp8(const __nv_bfloat16* gate_up, const int* row_src, const unsigned* counts,
                                          int num_local, int block_m, long long inter, __nv_fp8_e4m3* act,
                                          float* act_sf, long long sf_stride) {
    extern __shared__ unsigned offsets[];
    group_offsets(counts, num_local, block_m, offsets);
    const u64 used = offsets[num_local], I = static_cast<u64>(inter), blocks = I / kScaleBlock;
    const u32 lane = threadIdx.x % kWarp;
    const u64 warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp, warps = gridDim.x * blockDim.x / kWarp;
    for (u64 item = warp; item < used * blocks; item += warps) {
        const u64 row = item / blocks, block = item % blocks;
        if (row_src[row] < 0) continue;
        const u64 col = block * kScaleBlock + lane * 4;
        const __nv_bfloat16* g = gate_up + row * 2 * I + col;
        const uint2 graw = *reinterpret_cast<const uint2*>(g), uraw = *reinterpret_cast<const uint2*>(g + I);
        const auto* gv = reinterpret_cast<const __nv_bfloat16*>(&graw);
        const auto* uv = reinterpret_cast<const __nv_bfloat16*>(&uraw);
        float v[4], amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float gate = __bfloat162float(gv[j]);
            v[j] = moe::silu_mul(gate, __bfloat162float(uv[j]));
            amax = fmaxf(amax, fabsf(v[j]));
        }
#pragma unroll
        for (int offset = kWarp / 2; offset > 0; offset /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        const float scale = moe::e4m3_scale(amax);
        __align__(4) __nv_fp8_e4m3 q[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = __nv_fp8_e4m3(moe::clamp_e4m3(v[j] / scale));
        *reinterpret_cast<u32*>(act + row * I + col) = *reinterpret_cast<const u32*>(q);
        if (lane == 0) act_sf[block * sf_stride + row] = scale;
    }
}

// bf16 path: act [P, I] = silu(gate) * up in fp32, rounded to bf16; a block per row in use.
extern "C" __global__ void moe_swiglu_bf16(const __nv_bfloat16* gate_up, const int* row_src, const unsigned* counts,
                                           int num_local, int block_m, long long inter, __nv_bfloat16* act) {
    extern __shared__ unsigned offsets[];
    group_offsets(counts, num_local, block_m, offsets);
    const u64 used = offsets[num_local], I = static_cast<u64>(inter);
    for (u64 row = blockIdx.x; row < used; row += gridDim.x) {
        if (row_src[row] < 0) continue;
        const __nv_bfloat16* gate = gate_up + row * 2 * I;
        for (u64 i = threadIdx.x; i < I; i += blockDim.x) {
            const float g = __bfloat162float(gate[i]), u = __bfloat162float(gate[I + i]);
            act[row * I + i] = __float2bfloat16_rn(moe::silu_mul(g, u));
        }
    }
}

// One block per row in use (grid-stride): a real row of out [P, H] bf16, times its top-k weight in fp32
// and rounded to bf16 - the precision of the layer's output, which the source's reduction over k
// (fp32 accumulation) keeps - goes to its source's combine buffer [capacity * K, H] at token * K + k. A row of
// source own_rank (this rank; -1: none) stays in `out`: this rank's own reduction reads it there (own_row), after
// this call's held acks and drain in stream order, so nothing copies it.
// Per source, as the ring descriptor `desc` says (protocol/transport.cuh; null desc: every source DIRECT):
//   DIRECT: stores through peer_combine[src] (the source's combine buffer as this GPU addresses it);
//   RMA:    the weighted row overwrites its own row of `out`, then one non-blocking block put of it to
//           `combine` (this rank's combine buffer: a symmetric address, the same offset at every PE) on src.
//           `out` must be NVSHMEM-registered for an off-node source (the layer allocates it symmetric).
// pushed [1] (zeroed before the launch): every block, once its stores are released (and its puts
// delivered: put_done), adds 1; moe_ack_held (moe_stream.cu) acquires the count - every block's arrival -
// before it acknowledges the held chunks, so each source's owner sees these rows once it sees the ack
// (docs/PROTOCOL.md, "The MoE layer on the ring").
extern "C" __global__ void moe_combine_push(const __grid_constant__ CombinePushArgs args) {
    ptx::wait_prior_grid();
    ptx::release_dependents();
    require_args(args);
    auto* out = arg<__nv_bfloat16*>(args.out);
    const auto* row_src = arg<const int*>(args.row_src);
    const auto* row_token = arg<const int*>(args.row_token);
    const auto* row_k = arg<const int*>(args.row_k);
    const auto* row_weight = arg<const float*>(args.row_weight);
    const auto* counts = arg<const unsigned*>(args.counts);
    const int num_local = arg<int>(args.num_local);
    const int block_m = arg<int>(args.block_m);
    const long long hidden = arg<long long>(args.hidden);
    const int topk = arg<int>(args.topk);
    const auto* peer_combine = arg<const unsigned long long*>(args.peer_combine);
    const auto* desc = arg<const RingDesc*>(args.desc);  // null: no ring, every source DIRECT
    auto* combine = arg<__nv_bfloat16*>(args.combine);   // null without a ring
    const int own_rank = arg<int>(args.own_rank);
    auto* pushed = arg<unsigned long long*>(args.pushed);
    extern __shared__ unsigned offsets[];
    group_offsets(counts, num_local, block_m, offsets);
    const u64 used = offsets[num_local], H = static_cast<u64>(hidden);
    bool stored = false;  // whether this block pushed a row (uniform across the block)
    for (u64 row = blockIdx.x; row < used; row += gridDim.x) {
        const int src = row_src[row];
        if (src < 0 || src == own_rank) continue;  // uniform across the block: one row per block
        stored = true;
        const bool rma = desc != nullptr && chunkring::protocol::peer_is_rma(*desc, src);
        const float w = row_weight[row];
        const u64 at = (static_cast<u64>(row_token[row]) * topk + row_k[row]) * H;
        __nv_bfloat16* from = out + row * H;
        __nv_bfloat16* to = rma ? from : reinterpret_cast<__nv_bfloat16*>(peer_combine[src]) + at;
        for (u64 i = threadIdx.x * 8; i < H; i += blockDim.x * 8) {  // 8 values: one 16-byte load and store
            const int4 raw = *reinterpret_cast<const int4*>(from + i);
            const auto* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
            __align__(16) __nv_bfloat16 r[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) r[j] = weighted(v[j], w);
            *reinterpret_cast<int4*>(to + i) = *reinterpret_cast<const int4*>(r);
        }
        if (rma) chunkring::protocol::put_block(combine + at, from, H * sizeof(__nv_bfloat16), src);
    }
    // Every put of this block delivered at its source before its arrival (nvshmem_quiet).
    if (desc != nullptr && desc->rma_peers != 0) chunkring::protocol::put_done();
    __syncthreads();  // every thread's stores before thread 0's fence, which is then cumulative over them
    if (threadIdx.x == 0) {
        // release: fence, then the arrival. System scope, although the acquiring thread (moe_ack_held) is on
        // this GPU: the stores went to other GPUs' memory, where their reader is, and a system-scope fence
        // orders them at that scope before the arrival, so the edge needs nothing of how the ack's release
        // composes with a GPU-scope one for another GPU's memory. A block that pushed no row has nothing to
        // release: it arrives without the fence (at decode sizes nearly every block; at one rank every one). Its
        // relaxed add still carries the earlier arrivals' releases: an RMW continues the chain ack_held reads.
        if (kMutant != Mutant::kNoPushRelease && stored) ptx::fence_acq_rel_sys();
        atomicAdd(pushed, 1ull);  // NOTES: relaxed; the fence before it makes it the release
    }
}

// The owner's output: out[t] = sum over k of its choice's row for every routed choice (routing[t * K + k] >= 0),
// each element accumulated in fp32 in k order and rounded once to bf16 - one order whatever the call's chunking
// or the ranks that computed the rows, so streamed calls equal batch-ready bit for bit. `routing` [tokens, K] is
// this rank's own rows of the stage as its pull checked them (an out-of-range expert masked to -1, as every
// rank's pull masks it; rows past a valid count -1 as the host filled them): each routed choice's row was
// written in this call by the one rank that owns its expert, and a masked choice's row by none, so it is never
// read - the combine buffer needs no zeroing, and a token with no routed choice comes out 0.
// A choice's row: where own_row (nullable, [tokens * K]) names a plan row p >= 0 - a choice this rank computed
// itself, which moe_combine_push left in place - own_out's row p times weights[t * K + k], rounded to bf16 as the
// push rounds it; else combine row t * K + k.
// Stream-ordered after moe_drain, whose acquire saw every destination's ack (each sent after that destination's
// rows for this rank landed), and - on this rank's own streams - after its own held acks, which follow its L2, so
// every row read here is complete. Eight values per thread and step (one 16-byte load per k) where hidden % 8 == 0
// and the buffers are 16-byte aligned (a caller's `out` may be a view at any element offset), else one.
// desc (nullable: a reduction outside a ring's call, tests and benchmarks): the call's ring. Where this rank recorded
// an error in it - the drain gave up (a watchdog, a peer's abort) or an earlier kernel of the call did - some
// combine rows may be another call's, so `out` is zeros instead: a failed call never returns stale rows
// (docs/INTEGRATION.md, "Failing closed"). The record was made by a kernel ahead of this one in stream order.
extern "C" __global__ void moe_combine_reduce(const __grid_constant__ CombineReduceArgs args) {
    ptx::wait_prior_grid();
    require_args(args);
    const auto* desc = arg<const RingDesc*>(args.desc);  // null: a reduction outside a ring's call
    const auto* combine = arg<const __nv_bfloat16*>(args.combine);
    const auto* routing = arg<const int*>(args.routing);
    const auto* weights = arg<const float*>(args.weights);
    const auto* own_row = arg<const int*>(args.own_row);  // null, with own_out: no own rows
    const auto* own_out = arg<const __nv_bfloat16*>(args.own_out);
    auto* out = arg<__nv_bfloat16*>(args.out);
    const long long tokens = arg<long long>(args.tokens);
    const int topk = arg<int>(args.topk);
    const long long hidden = arg<long long>(args.hidden);
    constexpr bool kEveryChoice = kMutant == Mutant::kReduceEveryChoice;  // a negative control only
    const u64 n = static_cast<u64>(tokens), K = static_cast<u64>(topk), H = static_cast<u64>(hidden);
    const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
    const u64 first = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
    // NOTES: relaxed - the record's store is ordered before this launch by the kernel boundary.
    if (kMutant != Mutant::kReduceAfterError && desc != nullptr &&
        (!chunkring::protocol::check_descriptor(*desc) || chunkring::protocol::has_error(*desc))) {
        for (u64 i = first; i < n * H; i += stride) out[i] = __float2bfloat16_rn(0.0f);
        return;
    }
    // The plan row of choice i if it is one of this rank's own (left in own_out by the push), else -1.
    auto own_at = [&](u64 i) { return own_row != nullptr ? own_row[i] : -1; };
    using ::cuda::std::uintptr_t;
    const bool aligned = (reinterpret_cast<uintptr_t>(combine) | reinterpret_cast<uintptr_t>(out) |
                          reinterpret_cast<uintptr_t>(own_out)) % 16 == 0;
    if (H % 8 == 0 && aligned) {
        const u64 per_row = H / 8;  // 16-byte vectors per row
        const auto* rows = reinterpret_cast<const int4*>(combine);
        const auto* own_rows = reinterpret_cast<const int4*>(own_out);
        auto* dst = reinterpret_cast<int4*>(out);
        for (u64 i = first; i < n * per_row; i += stride) {
            const u64 t = i / per_row, c = i % per_row;
            float acc[8] = {};
            for (u64 k0 = 0; k0 < K; k0 += kReduceInFlight) {  // the loads of several k in flight, added in k order
                int4 raw[kReduceInFlight];
                bool routed[kReduceInFlight], own[kReduceInFlight];
                float weight[kReduceInFlight];  // an own row's top-k weight (a combine row is weighted already)
#pragma unroll
                for (u32 u = 0; u < kReduceInFlight; ++u) {
                    const u64 choice = t * K + k0 + u;
                    routed[u] = k0 + u < K && (routing[choice] >= 0 || kEveryChoice);
                    if (!routed[u]) continue;
                    const int p = own_at(choice);
                    own[u] = p >= 0;
                    weight[u] = own[u] ? weights[choice] : 0.0f;
                    raw[u] = own[u] ? own_rows[static_cast<u64>(p) * per_row + c] : rows[choice * per_row + c];
                }
#pragma unroll
                for (u32 u = 0; u < kReduceInFlight; ++u) {
                    if (!routed[u]) continue;
                    const auto* v = reinterpret_cast<const __nv_bfloat16*>(&raw[u]);
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        acc[j] += __bfloat162float(own[u] ? weighted(v[j], weight[u]) : v[j]);
                }
            }
            __align__(16) __nv_bfloat16 r[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) r[j] = __float2bfloat16_rn(acc[j]);
            dst[i] = *reinterpret_cast<const int4*>(r);
        }
        return;
    }
    for (u64 i = first; i < n * H; i += stride) {
        const u64 t = i / H, c = i % H;
        float acc = 0.0f;
        for (u64 k = 0; k < K; ++k) {
            const u64 choice = t * K + k;
            if (routing[choice] < 0 && !kEveryChoice) continue;
            const int p = own_at(choice);
            acc += __bfloat162float(p >= 0 ? weighted(own_out[static_cast<u64>(p) * H + c], weights[choice])
                                           : combine[choice * H + c]);
        }
        out[i] = __float2bfloat16_rn(acc);
    }
}

// ---------------------------------------------------------------------------------------------------
// One wave of incremental expert blocks (docs/PROTOCOL.md, "Incremental expert blocks", the wave claim
// rule): moe_wave_claim claims every sealed, unclaimed pool block, moe_wave_gather copies the claimed
// blocks' rows into a plan (the layout moe_plan_scatter builds: groups per expert, block_m-aligned), and
// the plan's GEMMs, SwiGLU and combine push are the batch path's own. Why a compacted copy rather than the
// pool itself with -1 labels on unclaimed blocks: DeepGEMM's per-row contiguous GEMM skips only the
// WGMMAs of a half block labelled -1; it still loads that block's rows and an expert's weights and stores
// a zero tile, over the pool's whole worst-case M, in every wave (docs/notes_deepgemm.md a).

// One block. Waits (thread 0, bounded) until at least `min_blocks` sealed blocks are unclaimed or the
// finisher sealed everything (`last`: only the latter), then claims every sealed block below pool_next:
// a compare-and-swap kSealed | n -> kClaimed | n, whose winner alone adds the block to wave_ids and its n
// rows to counts[expert] (zeroed by moe_plan_reset). The last wave checks that every allocated block was
// claimed (PROTOCOL.md step 9's exit test).
extern "C" __global__ void moe_wave_claim(const RingDesc* desc, const PoolDesc* pool_desc, int min_blocks, int last,
                                          unsigned* counts) {
    namespace blk = chunkring::moe::blocks;
    namespace protocol = chunkring::protocol;
    const RingDesc& d = *desc;
    if (!protocol::check_descriptor(d) || !chunkring::moe::check_pool(d, *pool_desc)) return;
    const blk::Pool pool = chunkring::moe::pool_of(*pool_desc);
    __shared__ bool ready;
    __shared__ u32 allocated, claimed_here;
    if (threadIdx.x == 0) {
        // NOTES: only the claim kernels write kClaimed, stream-ordered one after another: a plain read.
        const u32 claimed = *pool.counter(blk::kClaimed);
        const u32 want = last ? 1u : static_cast<u32>(min_blocks);
        ready = protocol::spin_until(d, Site::kWaitBlocks, d.my_pe, 0, want, [&](u64& observed) {
            if (ptx::ld_acquire_gpu(pool.counter(blk::kSealedAll)) != 0) return 1;  // acquire: every seal
            if (last) return 0;
            // NOTES: relaxed - a count only decides when to look; each claim's own CAS + fence acquires.
            observed = blk::sealed_unclaimed(ptx::ld_relaxed_gpu(pool.counter(blk::kSealed)), claimed);
            return observed >= want ? 1 : 0;
        });
        // NOTES: relaxed - an upper bound for the scan; a block allocated after this is claimed by a later wave
        // (the last wave reads it after sealed_all's acquire, when it no longer grows).
        allocated = min(ptx::ld_relaxed_gpu(pool.counter(blk::kPoolNext)), pool.blocks);
        claimed_here = 0;
        *pool.counter(blk::kWaveCount) = 0;
    }
    __syncthreads();
    if (!ready) return;  // recorded (timeout, or this rank's error): the wave computes nothing
    for (u32 id = threadIdx.x; id < allocated; id += blockDim.x) {
        // NOTES: relaxed - a candidate only; the CAS below decides, and the fence after it acquires.
        const u32 state = ptx::ld_relaxed_gpu(pool.state(id));
        if (!(state & blk::kSealedBit) || (state & blk::kClaimedBit)) continue;
        const u32 n = state & blk::kCountMask;
        // Exactly once: a block leaves kSealed only through this swap (the model's bug_claim_no_cas).
        if (atomicCAS(pool.state(id), state, blk::kClaimedBit | n) != state) continue;
        // acquire: pairs with the sealer's release, hence with every lander's (the rows, expert_of).
        ptx::fence_acq_rel_gpu();
        const u32 landed = ptx::ld_relaxed_gpu(pool.landed(id));  // NOTES: relaxed - after the acquire fence
        if (landed != n) {
            // A block sealed before its rows landed (the kSealOnReserve mutant): the direct detector.
            protocol::record_error(d, protocol::ErrorCode::kInternal, Site::kBlocks, d.my_pe, id, n, landed);
        }
        pool.wave_ids()[atomicAdd(pool.counter(blk::kWaveCount), 1u)] = id;
        atomicAdd(counts + *pool.expert_of(id), n);
        atomicAdd(&claimed_here, 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 claimed = *pool.counter(blk::kClaimed) + claimed_here;
        *pool.counter(blk::kClaimed) = claimed;
        // The exit test: after the finisher's seal every allocated block is sealed, so the last wave leaves
        // none behind; a block that was never sealed would be rows never computed.
        if (last && claimed != allocated)
            protocol::record_error(d, protocol::ErrorCode::kInternal, Site::kBlocks, d.my_pe, 0, allocated, claimed);
    }
}

// The claimed blocks' rows into a plan (moe_plan_scatter's layout and outputs; counts from
// moe_wave_claim, cursors [E_local] zeroed by moe_plan_reset): a warp per claimed pool row. Stream-ordered
// after moe_wave_claim, whose claimants acquired every row (kernel boundary: their acquires order these
// reads, in this later kernel of the same stream).
//   pool: x [P * bm, row_bytes], sf [P * bm, sf_per_row] (row-major, as the pull stored them), src, token, k, weight
extern "C" __global__ void moe_wave_gather(const __grid_constant__ WaveGatherArgs args) {
    namespace blk = chunkring::moe::blocks;
    require_args(args);
    const auto* pool_desc = arg<const PoolDesc*>(args.pool_desc);
    const auto* counts = arg<const unsigned*>(args.counts);
    auto* cursors = arg<unsigned*>(args.cursors);
    auto* rows = arg<unsigned char*>(args.rows);
    auto* rows_sf = arg<float*>(args.rows_sf);
    const long long sf_stride = arg<long long>(args.sf_stride);
    auto* row_src = arg<int*>(args.row_src);
    auto* row_token = arg<int*>(args.row_token);
    auto* row_k = arg<int*>(args.row_k);
    auto* row_weight = arg<float*>(args.row_weight);
    auto* group_end = arg<int*>(args.group_end);
    const PoolDesc& pd = *pool_desc;
    chunkring::moe::require_descriptor(pd);
    const blk::Pool pool = chunkring::moe::pool_of(pd);
    const int num_local = static_cast<int>(pool.experts), block_m = static_cast<int>(pool.block_m);
    const auto* pool_x = address<const unsigned char>(pd.x);
    const auto* pool_sf = address<const float>(pd.sf);
    const auto* pool_src = address<const int>(pd.src);
    const auto* pool_token = address<const int>(pd.token);
    const auto* pool_k = address<const int>(pd.k);
    const auto* pool_w = address<const float>(pd.weight);
    const u64 row_bytes = pd.row_bytes, sf_per_row = pd.sf_per_row;
    extern __shared__ unsigned offsets[];  // E_local + 1
    group_offsets(counts, num_local, block_m, offsets);
    if (blockIdx.x == 0)
        for (int e = threadIdx.x; e < num_local; e += blockDim.x) group_end[e] = offsets[e] + counts[e];
    const u64 claimed = *pool.counter(blk::kWaveCount), bm = static_cast<u64>(block_m);
    const u32 lane = threadIdx.x % kWarp;
    const u64 warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp, warps = gridDim.x * blockDim.x / kWarp;
    for (u64 item = warp; item < claimed * bm; item += warps) {
        const u32 id = pool.wave_ids()[item / bm];
        const u64 n = *pool.state(id) & blk::kCountMask, from = static_cast<u64>(id) * bm + item % bm;
        if (item % bm >= n) continue;  // uniform across the warp: one row per warp
        const u32 e = *pool.expert_of(id);
        u64 p = 0;
        if (lane == 0) p = offsets[e] + atomicAdd(cursors + e, 1u);
        p = __shfl_sync(0xffffffffu, p, 0);
        if (lane == 0) {
            row_src[p] = pool_src[from];
            row_token[p] = pool_token[from];
            row_k[p] = pool_k[from];
            row_weight[p] = pool_w[from];
        }
        util::warp_copy16(rows + p * row_bytes, pool_x + from * row_bytes, row_bytes, lane);
        for (u64 j = lane; j < sf_per_row; j += kWarp) rows_sf[j * sf_stride + p] = pool_sf[from * sf_per_row + j];
    }
}
