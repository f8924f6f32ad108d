// Streaming loads (PTX `ld.global.nc` with a cache hint). With ordering.cuh and mma.cuh, the only `asm`.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

// 16 bytes of read-only global memory that this kernel reads exactly once (the decode GEMM's expert
// weights): the non-coherent path, without allocating in L1. The data must not be written while the
// kernel runs. Why no L1 allocation: each weight byte is used by one warp once, and an allocating load
// would evict the token rows that the block's eight warps re-read from L1. `volatile` keeps the loads
// where the source issues them - a stage ahead of their use - rather than next to their first use; no
// "memory" clobber: this is not an ordering point, so ordinary loads and stores may move around it.
__device__ __forceinline__ uint4 ld_nc_no_allocate_v4(const void* ptr) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

}  // namespace chunkring::ptx
