// Block-cooperative copies: every thread of the block calls them with the same arguments.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::util {

using u64 = ::cuda::std::uint64_t;

// `bytes` must be a multiple of 16 and both pointers 16-byte aligned (RingSpec guarantees it for rows).
__device__ __forceinline__ void block_copy16(void* dst, const void* src, u64 bytes) {
    auto* d = static_cast<int4*>(dst);
    const auto* s = static_cast<const int4*>(src);
    for (u64 i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = s[i];
}

// `words` 4-byte words (topk_idx, topk_weights, scales).
__device__ __forceinline__ void block_copy4(void* dst, const void* src, u64 words) {
    auto* d = static_cast<unsigned*>(dst);
    const auto* s = static_cast<const unsigned*>(src);
    for (u64 i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
}

}  // namespace chunkring::util
