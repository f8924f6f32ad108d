// Checks of the MoE descriptors (layout/moe_desc.cuh) before a kernel reads anything through them. A
// kernel that has the ring records a mismatch as the ring's kBadDescriptor, like check_descriptor; the
// expert kernels, which take no ring, trap, since their host and device halves were built from different trees.
#pragma once

#include "chunkring/layout/moe_desc.cuh"
#include "chunkring/moe/blocks.cuh"
#include "chunkring/protocol/status.cuh"

namespace chunkring::moe {

using layout::PoolDesc;
using layout::StageDesc;
using blocks::u32;

// The stage's version and size, and its shapes against the ring's rows it is filled from.
__device__ __forceinline__ bool check_stage(const layout::RingDesc& d, const StageDesc& s) {
    const bool matches = layout::descriptor_matches(s) && s.sources == d.world_size && s.topk == d.topk &&
                         s.row_bytes == d.x_row_bytes && s.sf_per_row == d.x_sf_row_floats;
    if (!matches && threadIdx.x == 0)
        protocol::record_error(d, protocol::ErrorCode::kBadDescriptor, protocol::Site::kDescriptor, 0, 0,
                               layout::kMoeLayoutVersion, s.layout_version);
    return matches;
}

__device__ __forceinline__ bool check_pool(const layout::RingDesc& d, const PoolDesc& p) {
    const bool matches = layout::descriptor_matches(p) && p.row_bytes == d.x_row_bytes &&
                         p.sf_per_row == d.x_sf_row_floats;
    if (!matches && threadIdx.x == 0)
        protocol::record_error(d, protocol::ErrorCode::kBadDescriptor, protocol::Site::kDescriptor, 0, 0,
                               layout::kMoeLayoutVersion, p.layout_version);
    return matches;
}

template <typename Desc>
__device__ __forceinline__ void require_descriptor(const Desc& desc) {
    if (layout::descriptor_matches(desc)) return;
    if (threadIdx.x == 0 && blockIdx.x == 0)
        printf("chunkring: MoE descriptor version %llu (%llu bytes), this build expects %llu (%llu bytes)\n",
               static_cast<unsigned long long>(desc.layout_version), static_cast<unsigned long long>(desc.desc_bytes),
               static_cast<unsigned long long>(layout::kMoeLayoutVersion),
               static_cast<unsigned long long>(sizeof(Desc)));
    __trap();
}

// The pool's words and shape as moe/blocks.cuh's Pool.
__device__ __forceinline__ blocks::Pool pool_of(const PoolDesc& p) {
    return blocks::Pool{layout::address<u32>(p.words), static_cast<u32>(p.experts),
                        static_cast<u32>(p.blocks_per_expert), static_cast<u32>(p.blocks), static_cast<u32>(p.block_m)};
}

}  // namespace chunkring::moe
