// Bulk asynchronous copies into shared memory (PTX `cp.async.bulk`, the Hopper copy engine) and the
// shared-memory barriers (`mbarrier`) that report their completion. With ordering.cuh, mma.cuh and
// dependent_launch.cuh, the only `asm`.
//
// A bulk copy is not held by the thread that issues it (no per-thread copy groups, no registers): an SM keeps far
// more bytes in flight this way than with 16-byte per-thread copies, which is what a stream of weights needs to
// read at the memory's bandwidth from few SMs.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

__device__ __forceinline__ u32 shared_address(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Initialises a barrier expecting `arrivals` arrivals per phase (phase 0 first). Before any other thread or a bulk
// copy uses it: fence_barrier_init, then a barrier that orders the other threads after it.
__device__ __forceinline__ void mbarrier_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}

// Makes the barriers this thread initialised visible to the copy engine (the async proxy), which signals them.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival on the barrier's current phase that also expects `bytes` more bytes of bulk copies in it: the phase
// completes once every arrival came and every expected byte landed.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
                 "r"(bytes)
                 : "memory");
}

// Waits until the barrier's phase of parity `parity` (0 or 1: phase n has parity n % 2) has completed; acquire at
// CTA scope: the bytes the phase's bulk copies wrote are then visible to this thread.
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(shared_address(bar)),
        "r"(parity)
        : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) of global memory into shared memory; the bytes
// count towards `bar`'s current phase when they land. Read through L2 with an evict-first policy: a weight byte
// is read once per pass, and must not push out what the call's other kernels reuse. "memory" clobber: the compiler
// must not move this thread's reads of the destination past the copy that overwrites it.
__device__ __forceinline__ void bulk_copy_evict_first(void* shared, const void* global, u32 bytes, u64* bar) {
    asm volatile(
        "{\n"
        ".reg .b64 policy;\n"
        "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "policy;\n"
        "}\n" ::"r"(shared_address(shared)),
        "l"(global), "r"(bytes), "r"(shared_address(bar))
        : "memory");
}

}  // namespace chunkring::ptx
