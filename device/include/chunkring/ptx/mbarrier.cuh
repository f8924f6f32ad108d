// Shared-memory transaction barriers (PTX `mbarrier`, sm_90): the completion signal of the copy engine's bulk copies
// (bulk_copy.cuh) and the hand-over between a block's loader warp and its consumer warps
// (chunkring/util/stage_pipeline.cuh). Every `asm` of chunkring lives in ptx/.
//
// A barrier's phase completes when its pending arrivals reach zero and its transaction count is back to zero: a
// loader arrives once and announces the bytes its copies will deliver (arrive_expect_tx), the copies count them off
// as they land. Waits name the parity of the phase they wait for: a fresh barrier is in phase 0, and waiting for
// parity 1 returns at once (the phase before it counts as complete) - a ring's producer starts on its empty slots so.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

__device__ __forceinline__ u32 shared_address(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// One thread initialises a barrier for `arrivals` arrivals per phase, before any thread or copy uses it.
__device__ __forceinline__ void mbarrier_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}

// Makes the initialising thread's mbarrier_init visible to the copy engine (the async proxy); a block barrier
// afterwards makes it visible to the block's threads.
__device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives once (release, CTA scope: this thread's earlier shared-memory writes are seen by whoever's wait returns
// on the phase) and adds `bytes` to the phase's expected transaction count.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
                 ::"r"(shared_address(bar)), "r"(bytes) : "memory");
}

// Arrives once (release, CTA scope), expecting no bytes.
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

// Whether the phase of parity `parity` has completed (acquire, CTA scope: the writes released by its arrivals and
// the bytes its copies delivered are visible to this thread once it returns true). The hardware may suspend the
// thread for a while before answering false; callers loop, bounded (stage_pipeline.cuh wait_phase).
__device__ __forceinline__ bool mbarrier_try_wait_parity(u64* bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

}  // namespace chunkring::ptx
