// The copy engine (sm_90): bulk copies from global into shared memory that complete on a shared-memory transaction
// barrier (mbarrier.cuh) - a 2-D tile through a tensor map (`cp.async.bulk.tensor`, "TMA"), or a contiguous run
// of bytes (`cp.async.bulk`). One thread issues a copy; the bytes count off the barrier's transaction count as they
// land, so the issuing thread does not wait and holds no registers for them. Every `asm` of chunkring lives in ptx/.
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/ptx/mbarrier.cuh"

namespace chunkring::ptx {

// The 128-byte tensor map the driver's cuTensorMapEncodeTiled writes (CUDA's CUtensorMap, declared here so that no
// kernel needs the driver API's header). A kernel takes it by value as `const __grid_constant__ TensorMap`, so
// that its address is the parameter's own; the host encodes it with chunkring.jit.tensor_map.
struct alignas(64) TensorMap {
    u64 opaque[16];
};
static_assert(sizeof(TensorMap) == 128 && alignof(TensorMap) == 64, "CUtensorMap's size and alignment");

// Fetches a tensor map into the copy engine's descriptor cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tensormap(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// The box at (inner, outer) - in elements, inner the contiguous dimension - of a 2-D tensor map, into `dst`
// (aligned as the map's swizzle needs: 1024 bytes for 128-byte swizzling, else 128), completing on `bar`.
__device__ __forceinline__ void copy_tile_2d(void* dst, const TensorMap* map, int inner, int outer, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(shared_address(dst)), "l"(reinterpret_cast<u64>(map)), "r"(inner), "r"(outer), "r"(shared_address(bar))
        : "memory");
}

// The box at (c0, c1, c2, c3, c4) - in elements, c0 the contiguous dimension - of a 5-D tensor map, into `dst`
// (aligned as copy_tile_2d's), completing on `bar`. The box lands in shared memory innermost dimension first, so a
// map whose dimensions are not in the order of their strides rearranges rows on the way: the persistent decode
// consumer interleaves each expert's gate and up rows by 8 so (chunkring/moe/persistent_schedule.cuh).
__device__ __forceinline__ void copy_tile_5d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3, int c4,
                                             u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
        "[%7];" ::"r"(shared_address(dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(c4), "r"(shared_address(bar))
        : "memory");
}

// `bytes` contiguous bytes of global memory at `src` into `dst`, completing on `bar`: both addresses and the size
// multiples of 16.
__device__ __forceinline__ void copy_bulk(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
}

}  // namespace chunkring::ptx
