// The persistent decode consumer (issue 44): one block per SM runs a call's whole expert work - L1, SwiGLU and the
// activation's FP8 quantisation, and L2 - on the plan moe_plan_scatter builds, writing what today's decode kernels
// write (moe_decode.cu: act / act_sf and bf16 rows). runtime/chunkring/moe/_engine/persistent.py launches it.
//
//   warps 0-7    two math warpgroups: swap-AB FP8 WGMMA, scale promotion, epilogues (chunkring/moe/persistent_math.cuh)
//   warp 8       the weight loader: each step's 16 KB weight tile by one bulk tensor copy into a ring of `stages`
//                stages, running ahead across units and experts; it never waits for tokens
//   warp 9       the token loader: each step's token tile (8-row tensor copies of the rows in use, 1 KB each) and
//                their 1x128 scales (one bulk copy) into a ring of `token_stages`; before an L2 unit it waits until
//                every L1 unit of its expert has released its activation rows (`sync`, below)
//   warps 10-11  idle (the loaders' warpgroup gives its registers to the math: setmaxnreg pc::kLoaderRegisters /
//                pc::kMathRegisters, 56 / 224)
// What a unit, a pass and a step are, and the order every role walks them in: chunkring/moe/persistent_schedule.cuh.
//
// `phases`: kPhaseBoth runs L1 and L2 in one launch, an L2 unit waiting only for its own expert's L1 units (the
// counters); kPhaseL1 then kPhaseL2 are two launches of the same kernel, the kernel boundary in between (no waits).
//
// sync [E + 2] u32: sync[e] counts expert e's quantised L1 passes in this launch (one add with release per chunk and
// pass, after its activation stores; the token loader acquires it); sync[E] counts blocks finished; sync[E + 1] is the
// dynamic claim's ticket. The last block to finish zeroes all of them, so every launch starts from zeros (the host
// zeroes them once, at allocation): no reset launch.
//
// Dependent launch (ptx/dependent_launch.cuh): the host launches it with pdl, so its blocks may be placed while the
// kernel ahead (the plan's scatter) ends; each waits for that kernel's end before anything else. After its wait it
// lets its own dependent (the reduction, or the combine push) start: it waits only for its own blocks, every one of
// them started by the time that dependent may be placed.
//
// Resident blocks: an L2 unit may wait for L1 units of other blocks. Under a static claim those may belong to a block
// not yet running, so the launch must not have more blocks than can run at once (the host launches at most one per
// SM, and one fills an SM: its shared memory and registers); under the dynamic claim they belong to running blocks
// (persistent_schedule.cuh), so blocks that other work keeps off their SMs only start late.
// Every wait is bounded: past wait_limit_ns the block records what it waited for in `fault_record` (the address of a
// pinned host u64, or 0) and traps (persistent_schedule.cuh, "Faults": no printf here).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cuda/std/cstdint>

#include "chunkring/moe/kernel_args.cuh"
#include "chunkring/moe/persistent_math.cuh"
#include "chunkring/moe/persistent_schedule.cuh"
#include "chunkring/ptx/bulk_copy.cuh"
#include "chunkring/ptx/dependent_launch.cuh"
#include "chunkring/ptx/mbarrier.cuh"
#include "chunkring/ptx/ordering.cuh"
#include "chunkring/ptx/warpgroup.cuh"
#include "chunkring/util/kernel_params.cuh"
#include "chunkring/util/stage_pipeline.cuh"

using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::moe::PersistentGemmArgs;
using chunkring::ptx::TensorMap;

namespace {

namespace ptx = chunkring::ptx;
namespace util = chunkring::util;
namespace pc = chunkring::moe::persistent;
using pc::u32;
using pc::u64;

// A block's timeline record (timeline [grid, kTimelineWords] u64, when given): global-timer ns and counts.
constexpr u32 kTimelineWords = 8;
constexpr u32 kStartNs = 0, kFirstStageNs = 1, kLastL1Ns = 2, kLastL2Ns = 3, kEndNs = 4, kL1Units = 5, kL2Units = 6,
              kSm = 7;

// The launch's variants are in range (persistent.py checks them first; a kernel that indexed past its shared memory
// would fail far from the cause).
__device__ __forceinline__ bool arguments_fit(int experts, long long hidden, long long inter, int stages,
                                              int token_stages, int tile_cap, int claim, int phases, int w13_boxes) {
    const bool tile = tile_cap == 8 || tile_cap == 16 || tile_cap == 32 || tile_cap == 64;
    return experts >= 1 && experts <= static_cast<int>(pc::kMaxExperts) && hidden > 0 && inter > 0 &&
           hidden % pc::kKBlock == 0 && inter % pc::kKBlock == 0 && stages >= 1 &&
           stages <= static_cast<int>(util::kMaxStages) && token_stages >= 1 &&
           token_stages <= static_cast<int>(pc::kMaxTokenStages) && tile && claim >= pc::kStridedExperts &&
           claim <= pc::kDynamic && phases >= pc::kPhaseL1 && phases <= pc::kPhaseBoth &&
           (w13_boxes == 1 || w13_boxes == pc::kW13Groups);
}

// The weight loader (one thread): every step's weight tile, in the schedule's order. An L1 tile is one copy of the
// interleaving 5-D map (w13_boxes 1) or 16 copies of 8 rows from a map in w13's own dimension order (w13_boxes 16):
// the same 16 KB either way.
__device__ void load_weights(util::StagePipeline& pipe, unsigned char* ring, const pc::Schedule& s,
                             const pc::Active& a, pc::UnitWalk<true> walk, const TensorMap* w13_map,
                             const TensorMap* w2_map, u32 stages, u32 w13_boxes, const pc::Watch& watch) {
    ptx::prefetch_tensormap(w13_map);
    ptx::prefetch_tensormap(w2_map);
    util::Cursor c;
    for (u32 i = walk.first(s, watch); i < s.total; i = walk.next(i, s, watch)) {
        const pc::Unit u = s.unit(i, a);
        const u32 kblocks = s.kblocks(u.gemm);
        for (u32 p = 0; p < s.passes(u); ++p)
            for (u32 h = 0; h < s.halves(u.gemm); ++h)
                for (u32 kb = 0; kb < kblocks; ++kb) {
                    pipe.acquire(c, watch.limit_ns, pc::StageFault{watch, pc::kFaultWeightSlot});
                    pipe.commit(c, pc::kWeightStageBytes);
                    unsigned char* dst = ring + c.stage * pc::kWeightStageBytes;
                    const int k = static_cast<int>(kb * pc::kKBlock);
                    // L1: the tile's 8 groups of 8 columns start at column 128 block + 64 h
                    const int group = static_cast<int>((u.block * pc::kKBlock + h * 64) / 8);
                    if (u.gemm == pc::kL1 && w13_boxes == 1) {
                        // w13 as [E][I / 8 groups][gate, up][8 rows][H]: the 8 groups' 16 KB in one copy
                        ptx::copy_tile_5d(dst, w13_map, k, 0, 0, group, static_cast<int>(u.expert), pipe.full_of(c));
                    } else if (u.gemm == pc::kL1) {
                        // w13 as [E][gate, up][I / 8 groups][8 rows][H]: box 2q + gu (group + q, gate or up) at 1 KB
                        // 2q + gu, the interleaved tile's rows 16q + 8gu .. + 7
                        for (u32 box = 0; box < pc::kW13Groups; ++box)
                            ptx::copy_tile_5d(dst + box * pc::kTokenBoxRows * pc::kKBlock, w13_map, k, 0,
                                              group + static_cast<int>(box / 2), static_cast<int>(box % 2),
                                              static_cast<int>(u.expert), pipe.full_of(c));
                    } else {
                        // w2 as [E * H][I]
                        const int row = static_cast<int>(u.expert * s.hidden + u.block * pc::kTileRows);
                        ptx::copy_tile_2d(dst, w2_map, k, row, pipe.full_of(c));
                    }
                    c.advance(stages);
                }
    }
}

// Waits (one thread) until expert `expert`'s L1 passes (`units`: one per chunk and pass) have released their
// activation rows in this launch.
__device__ void wait_l1(const unsigned* done, u32 expert, u32 units, const pc::Watch& watch) {
    const u32* word = reinterpret_cast<const u32*>(done) + expert;
    if (ptx::ld_acquire_gpu(word) >= units) return;
    const u64 start = ptx::globaltimer_ns();
    while (ptx::ld_acquire_gpu(word) < units)
        if (ptx::globaltimer_ns() - start > watch.limit_ns)
            pc::raise_fault(watch, pc::kFaultL1Units, expert, 0, ptx::ld_acquire_gpu(word));
}

// What the token loader reads.
struct TokenSource {
    const TensorMap* rows_map;  // the plan's rows [P, H], boxes of 8 rows x 128 bytes
    const TensorMap* act_map;   // the activation [P, I], likewise
    const float* rows_sf;       // [H / 128, P]
    const float* act_sf;        // [I / 128, P]
    u64 sf_stride;              // P
    const unsigned* done;       // sync's counters
    bool wait_for_l1;           // kPhaseBoth: L2 units wait for their expert's L1 units
};

// The token loader (the whole warp): every step's token tile - 8-row boxes of the pass's rows, lane i the i-th - and
// the pass's scales for the step's k block (one bulk copy of whole 8-row groups: the plan's groups start on
// 128-row boundaries and the scales' rows are 16-byte aligned, which persistent.py checks).
__device__ void load_tokens(util::StagePipeline& pipe, unsigned char* tiles, float* scales, const pc::Schedule& s,
                            const pc::Active& a, pc::UnitWalk<false> walk, const TokenSource& src, u32 token_stages,
                            const pc::Watch& watch) {
    const u32 lane = threadIdx.x % pc::kWarp;
    if (lane == 0) {
        ptx::prefetch_tensormap(src.rows_map);
        ptx::prefetch_tensormap(src.act_map);
    }
    util::Cursor c;
    for (u32 i = walk.first(s, watch); i < s.total; i = walk.next(i, s, watch)) {
        const pc::Unit u = s.unit(i, a);
        const bool l1 = u.gemm == pc::kL1;
        if (!l1 && src.wait_for_l1) {
            if (lane == 0) wait_l1(src.done, u.expert, s.l1_releases(u.rows), watch);
            __syncwarp();
            ptx::fence_proxy_async_global();  // the rows were written by ordinary stores; the copy engine reads them
        }
        const TensorMap* map = l1 ? src.rows_map : src.act_map;
        const float* sf = l1 ? src.rows_sf : src.act_sf;
        const u32 kblocks = s.kblocks(u.gemm), halves = s.halves(u.gemm);
        for (u32 p = 0; p < s.passes(u); ++p) {
            const pc::Pass pass = s.pass(u, p);
            const u32 boxes = (pass.rows + pc::kTokenBoxRows - 1) / pc::kTokenBoxRows;
            const u32 bytes = boxes * pc::kTokenBoxRows * (pc::kKBlock + 4);
            for (u32 h = 0; h < halves; ++h)
                for (u32 kb = 0; kb < kblocks; ++kb) {
                    if (lane == 0) {
                        pipe.acquire(c, watch.limit_ns, pc::StageFault{watch, pc::kFaultTokenSlot});
                        pipe.commit(c, bytes);
                    }
                    __syncwarp();  // the transaction count is announced before any lane's copy can land
                    unsigned char* tile = tiles + c.stage * s.tile_cap * pc::kKBlock;
                    if (lane < boxes)
                        ptx::copy_tile_2d(tile + lane * pc::kTokenBoxRows * pc::kKBlock, map,
                                          static_cast<int>(kb * pc::kKBlock),
                                          static_cast<int>(pass.row0 + lane * pc::kTokenBoxRows), pipe.full_of(c));
                    if (lane == 0)
                        ptx::copy_bulk(scales + c.stage * s.tile_cap, sf + kb * src.sf_stride + pass.row0,
                                       boxes * pc::kTokenBoxRows * 4, pipe.full_of(c));
                    c.advance(token_stages);
                }
        }
    }
}

// The last block to finish zeroes the counters and the ticket for the next launch. NOTES: relaxed stores - the next
// launch reads them only after its wait for this kernel's end, and no block of this one reads them any more (each
// read, and each block's last claim, before its own add).
__device__ void finish(unsigned* sync, u32 experts) {
    u32* words = reinterpret_cast<u32*>(sync);
    if (ptx::atom_add_acq_rel_gpu(words + experts, 1) != gridDim.x - 1) return;
    for (u32 e = 0; e <= experts + 1; ++e) ptx::st_relaxed_gpu(words + e, 0);
}

}  // namespace

// The expert work of one call at one rank, as moe_decode_l1 + moe_decode_l2 do it, in one persistent kernel.
//   w13_map: w13 [E, 2I, H] e4m3 as the 5-D uint8 map [E][I / 8][2][8][H] (strides 2IH, 8H, IH, H, 1), box
//     1 x 8 x 2 x 8 x 128 (w13_boxes 1), or as [E][2][I / 8][8][H] (its own order), box 1 x 1 x 1 x 8 x 128
//     (w13_boxes 16); 128-byte swizzle; w2_map: w2 [E, H, I] as [E * H][I], box 128 x 128, 128-byte swizzle
//   rows_map: the plan's rows [P, H] uint8, box 8 x 128, 128-byte swizzle; act_map: act [P, I] likewise
//   w13_sf [E, 2I / 128, H / 128], w2_sf [E, H / 128, I / 128] fp32 (chunkring.moe.Fp8Weight)
//   rows_sf [H / 128, P], act_sf [I / 128, P]: scale j of row p at j * sf_stride + p (sf_stride = P, a multiple of 4)
//   counts [E], group_end [E]: the plan's groups (each starting on a multiple of 8 rows; the plan's are of 128)
//   act [P, I] e4m3, out [P, H] bf16: the groups' real rows written, others untouched
//   sync [E + 2]: zeros before the first launch (see the top); timeline [grid, kTimelineWords] u64 or null
//   wait_limit_ns: how long any wait may take; fault_record: where a block that gives up leaves its record (above)
//   stages, token_stages, tile_cap, claim, phases, w13_boxes: the variants (persistent_schedule.cuh)
// Launch: grid <= the SM count (static claims: every block resident at once), block pc::kThreads (384),
// pc::launch_shared_bytes(stages, token_stages, tile_cap) bytes of dynamic shared memory; hidden % 128 == 0,
// inter % 128 == 0, E <= pc::kMaxExperts.
extern "C" __global__ void __launch_bounds__(pc::kThreads, 1)
    moe_persistent_gemm(const __grid_constant__ TensorMap w13_map, const __grid_constant__ TensorMap w2_map,
                        const __grid_constant__ TensorMap rows_map, const __grid_constant__ TensorMap act_map,
                        const __grid_constant__ PersistentGemmArgs args) {
    ptx::wait_prior_grid();
    ptx::release_dependents();
    require_args(args);
    const auto* w13_sf = arg<const float*>(args.w13_sf);
    const auto* w2_sf = arg<const float*>(args.w2_sf);
    const auto* rows_sf = arg<const float*>(args.rows_sf);
    auto* act_sf = arg<float*>(args.act_sf);
    const auto* counts = arg<const unsigned*>(args.counts);
    const auto* group_end = arg<const int*>(args.group_end);
    const int experts = arg<int>(args.experts);
    const long long hidden = arg<long long>(args.hidden);
    const long long inter = arg<long long>(args.inter);
    const long long sf_stride = arg<long long>(args.sf_stride);
    auto* act = arg<__nv_fp8_e4m3*>(args.act);
    auto* out = arg<__nv_bfloat16*>(args.out);
    auto* sync = arg<unsigned*>(args.sync);
    const int stages = arg<int>(args.stages);
    const int token_stages = arg<int>(args.token_stages);
    const int tile_cap = arg<int>(args.tile_cap);
    const int claim = arg<int>(args.claim);
    const int phases = arg<int>(args.phases);
    const int w13_boxes = arg<int>(args.w13_boxes);
    const long long wait_limit_ns = arg<long long>(args.wait_limit_ns);
    const unsigned long long fault_record = arg<unsigned long long>(args.fault_record);
    auto* timeline = arg<unsigned long long*>(args.timeline);
    __shared__ util::StagePipeline weight_pipe;
    __shared__ util::StagePipeline token_pipe;
    __shared__ pc::Active active;
    __shared__ pc::Claims claims;
    __shared__ pc::MathTimes times;
    extern __shared__ unsigned char dynamic_shared[];
    const pc::Watch watch{fault_record, static_cast<u64>(wait_limit_ns)};
    if (!arguments_fit(experts, hidden, inter, stages, token_stages, tile_cap, claim, phases, w13_boxes))
        pc::raise_fault(watch, pc::kFaultArguments, 0, 0, 0);
    const u32 warp = threadIdx.x / pc::kWarp, lane = threadIdx.x % pc::kWarp;
    const u32 depth = static_cast<u32>(stages), token_depth = static_cast<u32>(token_stages),
              cap = static_cast<u32>(tile_cap);
    const pc::SharedLayout layout = pc::shared_layout(depth, token_depth, cap);
    const u32 base = ptx::shared_address(dynamic_shared);
    unsigned char* smem = dynamic_shared + ((base + pc::kStageAlign - 1) / pc::kStageAlign * pc::kStageAlign - base);
    if (threadIdx.x == 0) {
        weight_pipe.init(depth, pc::kMathWarps);
        token_pipe.init(token_depth, pc::kMathWarps);
        claims.pipe.init(pc::kClaimDepth, pc::kClaimConsumers);
        times = pc::MathTimes{};
        times.start = ptx::globaltimer_ns();
    }
    if (warp == 0) pc::build_active(active, counts, group_end, static_cast<u32>(experts), watch);
    __syncthreads();
    const pc::Schedule s = pc::make_schedule(active, static_cast<u64>(hidden), static_cast<u64>(inter), cap, claim,
                                             phases);
    unsigned* ticket = sync + experts + 1;
    if (warp >= pc::kMathWarps) {
        ptx::setmaxnreg_dec<pc::kLoaderRegisters>();
        if (warp == pc::kWeightLoaderWarp && lane == 0)
            load_weights(weight_pipe, smem + layout.weights, s, active, pc::UnitWalk<true>{&claims, ticket},
                         &w13_map, &w2_map, depth, static_cast<u32>(w13_boxes), watch);
        if (warp == pc::kTokenLoaderWarp)
            load_tokens(token_pipe, smem + layout.tokens, reinterpret_cast<float*>(smem + layout.token_scales), s,
                        active, pc::UnitWalk<false>{&claims, nullptr},
                        TokenSource{&rows_map, &act_map, rows_sf, act_sf, static_cast<u64>(sf_stride), sync,
                                    phases == pc::kPhaseBoth},
                        token_depth, watch);
    } else {
        ptx::setmaxnreg_inc<pc::kMathRegisters>();
        const pc::MathArgs m{smem + layout.weights, smem + layout.tokens,
                             reinterpret_cast<const float*>(smem + layout.token_scales),
                             reinterpret_cast<float*>(smem + layout.amax), &weight_pipe, &token_pipe, depth,
                             token_depth, watch, w13_sf, w2_sf, static_cast<u64>(sf_stride), act, act_sf, out,
                             sync};
        pc::run_math(m, s, active, pc::UnitWalk<false>{&claims, nullptr}, times);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (timeline != nullptr) {
            unsigned long long* r = timeline + static_cast<u64>(blockIdx.x) * kTimelineWords;
            r[kStartNs] = times.start;
            r[kFirstStageNs] = times.first_step;
            r[kLastL1Ns] = times.last_l1;
            r[kLastL2Ns] = times.last_l2;
            r[kEndNs] = ptx::globaltimer_ns();
            r[kL1Units] = times.l1_units;
            r[kL2Units] = times.l2_units;
            r[kSm] = ptx::sm_id();
        }
        finish(sync, static_cast<u32>(experts));
    }
}
