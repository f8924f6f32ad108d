// Block-cooperative copies: every thread of the block calls them with the same arguments.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::util {

using u64 = ::cuda::std::uint64_t;

// `bytes` must be a multiple of 16 and both pointers 16-byte aligned (RingSpec guarantees it for rows).
// Eight 16-byte loads in flight per thread before their stores: one block is latency-bound otherwise
// (a one-load-per-iteration loop moved ~15 GB/s on an H200 publishing an 8 MB chunk from one block).
__device__ __forceinline__ void block_copy16(void* dst, const void* src, u64 bytes) {
    constexpr u64 kInFlight = 8;
    auto* d = static_cast<int4*>(dst);
    const auto* s = static_cast<const int4*>(src);
    const u64 n = bytes / 16, stride = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + (kInFlight - 1) * stride < n; i += kInFlight * stride) {
        int4 v[kInFlight];
#pragma unroll
        for (u64 u = 0; u < kInFlight; ++u) v[u] = s[i + u * stride];
#pragma unroll
        for (u64 u = 0; u < kInFlight; ++u) d[i + u * stride] = v[u];
    }
    for (; i < n; i += stride) d[i] = s[i];
}

// A warp copies `bytes` (a multiple of 16, both pointers 16-byte aligned): each lane keeps up to eight
// 16-byte loads in flight before storing them - one load per lane per iteration leaves a warp copying a
// 4 KB row latency-bound, eight round trips in a row.
__device__ __forceinline__ void warp_copy16(void* dst, const void* src, u64 bytes, unsigned lane) {
    constexpr unsigned kInFlight = 8, kWarp = 32;
    auto* d = static_cast<int4*>(dst);
    const auto* s = static_cast<const int4*>(src);
    const u64 n = bytes / 16;
    for (u64 base = 0; base < n; base += kInFlight * kWarp) {
        int4 v[kInFlight];
#pragma unroll
        for (unsigned u = 0; u < kInFlight; ++u) {
            const u64 i = base + u * kWarp + lane;
            if (i < n) v[u] = s[i];
        }
#pragma unroll
        for (unsigned u = 0; u < kInFlight; ++u) {
            const u64 i = base + u * kWarp + lane;
            if (i < n) d[i] = v[u];
        }
    }
}

// `words` 4-byte words (topk_idx, topk_weights, scales).
__device__ __forceinline__ void block_copy4(void* dst, const void* src, u64 words) {
    auto* d = static_cast<unsigned*>(dst);
    const auto* s = static_cast<const unsigned*>(src);
    for (u64 i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
}

}  // namespace chunkring::util
