// The plan's groups (runtime/chunkring/moe/_engine/experts.py DevicePlan): each local expert's rows start on a
// multiple of block_m rows, in expert order. One scan, shared by every kernel that builds or walks a plan
// (moe_experts.cu, and moe_stream.cu's one-rank plan).
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::moe {

namespace plan_detail {
using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;
constexpr u32 kWarp = 32;
__device__ __forceinline__ u64 round_up(u64 x, u64 m) { return (x + m - 1) / m * m; }
}  // namespace plan_detail

// offsets[e] = first row of expert e's group, offsets[E] = rows in use: the exclusive scan of the
// padded counts, computed by every block that needs it (E is small; a launch for it would cost more).
// All threads of the block call it, in whole warps (blockDim.x a multiple of 32, at most 1024); offsets is shared
// memory of E + 1 words. Each thread sums a run of experts, the warps scan their threads' sums with shuffles and
// warp 0 scans the warps' totals: two chains of 5 shuffles, where one thread walking every thread's sum would take
// blockDim.x dependent shared-memory steps on the critical path of every plan kernel.
__device__ inline void group_offsets(const unsigned* counts, int num_local, int block_m, unsigned* offsets) {
    using namespace plan_detail;
    __shared__ unsigned warp_base[kWarp];  // per warp: its threads' total, then the sum of the warps before it
    const u32 per_thread = (num_local + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(threadIdx.x * per_thread, static_cast<u32>(num_local));
    const u32 hi = min(lo + per_thread, static_cast<u32>(num_local));
    unsigned sum = 0;
    for (u32 e = lo; e < hi; ++e) sum += round_up(counts[e], block_m);
    const u32 lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
    unsigned inclusive = sum;  // this warp's threads' sums up to this lane
    for (u32 d = 1; d < kWarp; d *= 2) {
        const unsigned v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    if (lane == kWarp - 1) warp_base[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const unsigned total = lane < warps ? warp_base[lane] : 0;
        unsigned run = total;
        for (u32 d = 1; d < kWarp; d *= 2) {
            const unsigned v = __shfl_up_sync(0xffffffffu, run, d);
            if (lane >= d) run += v;
        }
        if (lane < warps) warp_base[lane] = run - total;
        if (lane == kWarp - 1) offsets[num_local] = run;  // every warp's sum (lanes past `warps` added 0)
    }
    __syncthreads();
    unsigned run = warp_base[warp] + inclusive - sum;
    for (u32 e = lo; e < hi; ++e) {
        offsets[e] = run;
        run += round_up(counts[e], block_m);
    }
    __syncthreads();
}

// The rows the groups take, padding included (group_offsets' offsets[E]), from the group ends a plan kernel wrote:
// the last group's end rounded up, since every group starts on a multiple of block_m (an empty last group ends where
// the one before it ends, padded).
__device__ __forceinline__ plan_detail::u64 rows_in_use(const int* group_end, int num_local, int block_m) {
    return num_local > 0 ? plan_detail::round_up(static_cast<plan_detail::u64>(group_end[num_local - 1]), block_m) : 0;
}

}  // namespace chunkring::moe
