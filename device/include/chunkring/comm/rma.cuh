// NVSHMEM get/put calls, wrapped once under names that say what they complete. Facts from NVSHMEM
// 3.4.5's headers (device/nvshmemx_defines.h, non_abi/device/common/nvshmemi_common_device.cuh): to a
// peer NVSHMEM maps (P2P), a get or put is a copy by the calling threads through the peer's mapping,
// done when the call returns; to any other peer it is a request to the network proxy (IBGDA is compiled
// out, comm/nvshmem.cuh), done later. nvshmem_quiet completes every get and put this PE issued: P2P-only
// jobs get a __threadfence_system by the calling thread, others the proxy's wait for every outstanding
// operation. Local buffers of a get or put to an off-node peer must be NVSHMEM-registered memory (the
// symmetric heap is).
#pragma once

#include "chunkring/comm/nvshmem.cuh"

namespace chunkring::comm {

using u64 = ::cuda::std::uint64_t;

// One 64-bit word of `src` on `pe`, returned when it arrived (a blocking get, no local buffer needed).
__device__ __forceinline__ u64 get_u64(const u64* src, int pe) { return nvshmem_uint64_g(src, pe); }

// Block-level (every thread, same arguments): `bytes` of `src` on `pe` into local `dst`; the bytes are in
// `dst`, visible to the block, when it returns.
__device__ __forceinline__ void get_block(void* dst, const void* src, u64 bytes, int pe) {
    nvshmemx_getmem_block(dst, src, bytes, pe);
}

// Warp-level (every lane, same arguments): start copying `bytes` of `src` on `pe` into local `dst`.
// NOTES: not complete on return; quiet() completes it.
__device__ __forceinline__ void get_warp_nbi(void* dst, const void* src, u64 bytes, int pe) {
    nvshmemx_getmem_nbi_warp(dst, src, bytes, pe);
}

// Block-level (every thread, same arguments): start copying local `src` into `dst` on `pe`.
// NOTES: not delivered on return, and `src` must not change until quiet() returned.
__device__ __forceinline__ void put_block_nbi(void* dst, const void* src, u64 bytes, int pe) {
    nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
}

// Complete every get and put this PE issued: gets' bytes are in their local buffers, puts' bytes in
// the peers' memory. NOTES: no ordering of other memory operations beyond that (callers add fences).
__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

}  // namespace chunkring::comm
