// A block's ring of shared-memory stages between one loader warp and its consumer warps, handed over through two
// transaction barriers per stage (ptx/mbarrier.cuh): `full` completes when the stage's bytes have landed (the
// loader's arrive_expect_tx plus its bulk copies, ptx/bulk_copy.cuh), `empty` when every consumer warp has
// released it. The stage count is a run-time value up to kMaxStages, so one build serves every depth.
//
//   loader:   acquire(c) -> [write stage metadata] -> commit(c, bytes) -> issue copies on full_of(c) -> c.advance
//   consumer: wait(c)    -> read the stage       -> release(c)                                   -> c.advance
//
// Both sides walk the stages in the same order with a Cursor each: a stage's lap alternates the parity of its
// barriers' phases. Every wait is bounded: past `limit_ns` it gives up - by default prints who waited for what and
// traps (PrintAndTrap) - as a lost arrival or a copy whose bytes never match what was announced would otherwise hang
// the GPU.
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/ptx/mbarrier.cuh"
#include "chunkring/ptx/ordering.cuh"

namespace chunkring::util {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

constexpr u32 kMaxStages = 32;

// A stage and the parity of its current lap.
struct Cursor {
    u32 stage = 0;
    u32 parity = 0;
    __device__ __forceinline__ void advance(u32 stages) {
        if (++stage == stages) {
            stage = 0;
            parity ^= 1;
        }
    }
};

// What a wait past its limit does unless its caller says otherwise: prints who waited for what, then traps. A
// kernel that must hold no call (printf is one; ptxas serialises every WGMMA of such a kernel, C7510) passes its own
// `give_up` to the waits below instead - any callable (stage, parity, limit_ns) that does not return.
struct PrintAndTrap {
    const char* who;
    __device__ __forceinline__ void operator()(u32 stage, u32 parity, u64 limit_ns) const {
        printf("chunkring: block %u thread %u (%s) waited %llu ns for stage %u, parity %u\n", blockIdx.x, threadIdx.x,
               who, static_cast<unsigned long long>(limit_ns), stage, parity);
        __trap();
    }
};

// Waits for the phase of parity `parity` of `bar` (stage `stage` of a ring) to complete; past limit_ns of the global
// timer, give_up(stage, parity, limit_ns).
template <typename GiveUp>
__device__ __forceinline__ void wait_phase(u64* bar, u32 stage, u32 parity, u64 limit_ns, const GiveUp& give_up) {
    if (ptx::mbarrier_try_wait_parity(bar, parity)) return;
    const u64 start = ptx::globaltimer_ns();
    while (!ptx::mbarrier_try_wait_parity(bar, parity))
        if (ptx::globaltimer_ns() - start > limit_ns) give_up(stage, parity, limit_ns);
}

// Lives in static shared memory; `init` by one thread, then a block barrier, before any other use.
struct StagePipeline {
    u64 full[kMaxStages];
    u64 empty[kMaxStages];

    // `stages` <= kMaxStages; `consumers`: the arrivals that release a stage (one per consumer warp).
    __device__ __forceinline__ void init(u32 stages, u32 consumers) {
        for (u32 s = 0; s < stages; ++s) {
            ptx::mbarrier_init(&full[s], 1);
            ptx::mbarrier_init(&empty[s], consumers);
        }
        ptx::fence_mbarrier_init_release_cluster();
    }

    __device__ __forceinline__ u64* full_of(const Cursor& c) { return &full[c.stage]; }

    // Loader: waits until every consumer has released the cursor's stage from its previous lap (at once on the
    // first lap).
    template <typename GiveUp = PrintAndTrap>
    __device__ __forceinline__ void acquire(const Cursor& c, u64 limit_ns, const GiveUp& give_up = {"loader"}) {
        wait_phase(&empty[c.stage], c.stage, c.parity ^ 1, limit_ns, give_up);
    }

    // Loader: arrives on the stage's full barrier announcing `bytes` (0: a stage that carries only what was written
    // before, e.g. an end marker). Release: shared-memory writes before it are seen by the consumers' wait.
    __device__ __forceinline__ void commit(const Cursor& c, u32 bytes) {
        if (bytes == 0) {
            ptx::mbarrier_arrive(&full[c.stage]);
        } else {
            ptx::mbarrier_arrive_expect_tx(&full[c.stage], bytes);
        }
    }

    // Consumer: waits until the stage's bytes have landed (acquire: they, and what the loader wrote before its
    // commit, are visible to this thread).
    template <typename GiveUp = PrintAndTrap>
    __device__ __forceinline__ void wait(const Cursor& c, u64 limit_ns, const GiveUp& give_up = {"consumer"}) {
        wait_phase(&full[c.stage], c.stage, c.parity, limit_ns, give_up);
    }

    // Consumer: one lane per consumer warp, once the warp's reads of the stage are done (their values used, then a
    // __syncwarp), releases it to the loader.
    __device__ __forceinline__ void release(const Cursor& c) { ptx::mbarrier_arrive(&empty[c.stage]); }
};

}  // namespace chunkring::util
