// Checks of the MoE descriptors (layout/moe_desc.cuh) before a kernel reads anything through them. A
// kernel that has the ring records a mismatch as an internal error naming the field (DescCheck); the expert
// kernels, which take no ring, trap: only host and device halves built from different trees can disagree
// there (the host builds each descriptor from the tensors it checked), and that build is unusable anyway.
#pragma once

#include "chunkring/layout/moe_desc.cuh"
#include "chunkring/moe/blocks.cuh"
#include "chunkring/protocol/status.cuh"

namespace chunkring::moe {

using layout::PoolDesc;
using layout::StageDesc;
using blocks::u32;
using layout::u64;

// Which part of a MoE descriptor a kernel found wrong: the slot word of its error record.
enum DescField : u64 {
    kFieldVersion = 1, kFieldBytes = 2, kFieldSources = 3, kFieldTopk = 4, kFieldRowBytes = 5, kFieldSfPerRow = 6,
    kFieldExperts = 7,
};

// Records the first (field, expected, observed) that differs. The ring itself is valid here (check_descriptor
// passed), so unlike kBadDescriptor this reports as any internal error does: the host's failure word and the
// abort, so peers stop at once instead of waiting for this rank's pull or acks until their watchdog.
struct DescCheck {
    const layout::RingDesc& d;
    bool ok = true;
    __device__ void expect(DescField field, u64 expected, u64 observed) {
        if (!ok || expected == observed) return;
        ok = false;
        if (threadIdx.x == 0)
            protocol::record_error(d, protocol::ErrorCode::kInternal, protocol::Site::kDescriptor, 0, field,
                                   expected, observed);
    }
    template <typename Desc>
    __device__ void header(const Desc& desc) {
        expect(kFieldVersion, layout::kMoeLayoutVersion, desc.layout_version);
        expect(kFieldBytes, sizeof(Desc), desc.desc_bytes);
    }
};

// The stage's version and size, and its shapes against the ring's rows it is filled from.
__device__ __forceinline__ bool check_stage(const layout::RingDesc& d, const StageDesc& s) {
    DescCheck check{d};
    check.header(s);
    check.expect(kFieldSources, d.world_size, s.sources);
    check.expect(kFieldTopk, d.topk, s.topk);
    check.expect(kFieldRowBytes, d.x_row_bytes, s.row_bytes);
    check.expect(kFieldSfPerRow, d.x_sf_row_floats, s.sf_per_row);
    return check.ok;
}

// The pool's version and size, its rows against the ring's, and its experts against the stage's range.
__device__ __forceinline__ bool check_pool(const layout::RingDesc& d, const PoolDesc& p, const StageDesc* s = nullptr) {
    DescCheck check{d};
    check.header(p);
    check.expect(kFieldRowBytes, d.x_row_bytes, p.row_bytes);
    check.expect(kFieldSfPerRow, d.x_sf_row_floats, p.sf_per_row);
    if (s != nullptr) check.expect(kFieldExperts, s->expert_hi - s->expert_lo, p.experts);
    return check.ok;
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
