// The MoE layer's descriptors: where one rank's stage and block pool live and how they are shaped. Built
// once per layer by the host (runtime/chunkring/moe/_engine/descriptors.py: STAGE_FIELDS, POOL_FIELDS, in this order;
// tests/unit/test_moe_descriptors.py compares them); kernels take a pointer to one instead of a dozen loose
// arguments, and check its version and size before reading anything else.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::layout {

using u64 = ::cuda::std::uint64_t;

constexpr u64 kMoeLayoutVersion = 1;  // == runtime/chunkring/moe/_engine/descriptors.py MOE_LAYOUT_VERSION

// What one rank's consumer pulls in a call (runtime/chunkring/moe/_engine/stage.py Stage): every source's rows
// at their token index, sources * token_capacity of them.
struct StageDesc {
    u64 layout_version;  // kMoeLayoutVersion
    u64 desc_bytes;      // sizeof(StageDesc), as the host computed it
    u64 sources;         // W
    u64 token_capacity;  // N: rows per source
    u64 topk;            // K
    u64 row_bytes;       // payload bytes of a row (FP8: H, bf16: 2H)
    u64 sf_per_row;      // fp32 scales of a row (FP8: H/128, bf16: 0)
    u64 expert_lo;       // this rank's experts: [expert_lo, expert_hi)
    u64 expert_hi;
    u64 x;               // unsigned char [W, N, row_bytes]
    u64 sf;              // float [W, N, sf_per_row]
    u64 idx;             // int [W, N, K]: -1 planned nowhere
    u64 w;               // float [W, N, K]
    u64 held;            // unsigned long long [W]: per source, the seq of the chunk whose ack waits for the combine
};
static_assert(sizeof(StageDesc) == 14 * sizeof(u64), "StageDesc must match runtime/chunkring/moe/_engine/descriptors.py");

// One rank's pool of incremental expert blocks (runtime/chunkring/moe/_engine/blocks.py BlockPool; the words'
// layout is moe/blocks.cuh's).
struct PoolDesc {
    u64 layout_version;     // kMoeLayoutVersion
    u64 desc_bytes;         // sizeof(PoolDesc)
    u64 experts;            // E: local experts
    u64 blocks_per_expert;  // J
    u64 blocks;             // P
    u64 block_m;            // bm: rows per block
    u64 row_bytes;          // as StageDesc
    u64 sf_per_row;
    u64 words;              // unsigned [moe/blocks.cuh words]
    u64 pos;                // unsigned [W * N * K]: each choice's pool row between the pull's two passes
    u64 x;                  // unsigned char [P * bm, row_bytes]
    u64 sf;                 // float [P * bm, sf_per_row]
    u64 src;                // int [P * bm]
    u64 token;              // int [P * bm]
    u64 k;                  // int [P * bm]
    u64 weight;             // float [P * bm]
};
static_assert(sizeof(PoolDesc) == 16 * sizeof(u64), "PoolDesc must match runtime/chunkring/moe/_engine/descriptors.py");

template <typename T>
__device__ __forceinline__ T* address(u64 pointer) { return reinterpret_cast<T*>(pointer); }

template <typename Desc>
__device__ __forceinline__ bool descriptor_matches(const Desc& desc) {
    return desc.layout_version == kMoeLayoutVersion && desc.desc_bytes == sizeof(Desc);
}

}  // namespace chunkring::layout
