// Incremental expert blocks (docs/PROTOCOL.md, "Incremental expert blocks"; model: docs/model/blocks.pml):
// the pull (moe_pull_blocks, moe_stream.cu) reserves each (token, k) row of a local expert a place in a
// block of block_m rows of that expert, stores it there, lands it, and seals the block when it is full;
// when every pull block has finished every source, the finisher seals the partial blocks. The waves
// (moe_wave_claim / moe_wave_gather, moe_experts.cu) claim sealed blocks, each exactly once.
//
// Every word here is this GPU's own memory, written and read only by kernels on this GPU (the pull and
// the waves of one rank), so GPU scope suffices for every fence and atomic; nothing crosses GPUs.
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/protocol/mutants.cuh"
#include "chunkring/protocol/rules.cuh"  // status.cuh needs its u64
#include "chunkring/protocol/status.cuh"
#include "chunkring/ptx/ordering.cuh"

namespace chunkring::moe::blocks {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;
using layout::RingDesc;
using protocol::ErrorCode;
using protocol::Site;

// The words of one rank's pool, one u32 array (runtime/chunkring/moe/_engine/blocks.py BlockWords mirrors it):
//   [0, kHeader): the counters below
//   reserve[E]        rows reserved per local expert (RESERVE)
//   block_of[E * J]   pool id + 1 of expert e's block j (0: not yet allocated)
//   landed[P]         rows landed per pool block (LAND)
//   state[P]          kEmpty, kSealed | n, kClaimed | n
//   expert_of[P]      the local expert whose rows a pool block holds (written by its allocator)
//   wave_ids[P]       the pool ids the current wave claimed, wave_count of them
enum Counter : u32 {
    kPoolNext = 0,   // pool blocks allocated (allocating lanes, atomicAdd)
    kEnded = 1,      // pull blocks done with every source (each adds 1; the one making it gridDim.x finishes)
    kSealedAll = 2,  // 1 once the finisher sealed the partial blocks (st.release)
    kClaimed = 3,    // blocks claimed by the waves so far (the claim kernels only)
    kSealed = 4,     // blocks sealed so far (each sealer, after its seal)
    kWaveCount = 5,  // blocks the current wave claimed (its claim kernel; read by its gather)
    kHeader = 8,
};

constexpr u32 kEmpty = 0, kSealedBit = 1u << 30, kClaimedBit = 1u << 31, kCountMask = kSealedBit - 1;
constexpr u32 kNoRow = ~0u;  // a choice with no pool row (not a local expert, or an overflow)

// The waves' hint: sealed blocks no wave has claimed yet, from the two counters. A sealer bumps kSealed
// after its seal's store, so a wave can claim a block before its seal is counted: `claimed` may run ahead
// of `sealed` for a while. Their u32 difference would then wrap to ~4 billion and start a wave early; a
// count behind the claims means "none unclaimed yet".
constexpr __host__ __device__ u32 sealed_unclaimed(u32 sealed, u32 claimed) {
    return sealed > claimed ? sealed - claimed : 0u;
}
static_assert(sealed_unclaimed(5, 3) == 2 && sealed_unclaimed(3, 3) == 0);
static_assert(sealed_unclaimed(0, 1) == 0 && sealed_unclaimed(3, 5) == 0, "claims ahead of the count: none");
static_assert(sealed_unclaimed(~0u, 0) == ~0u && sealed_unclaimed(0, ~0u) == 0);

struct Pool {
    u32* words;
    u32 experts, blocks_per_expert, blocks, block_m;  // E, J, P, bm

    __device__ u32* counter(Counter c) const { return words + c; }
    __device__ u32* reserve(u32 e) const { return words + kHeader + e; }
    __device__ u32* block_of(u32 e, u32 j) const { return words + kHeader + experts + e * blocks_per_expert + j; }
    __device__ u32* landed(u32 id) const { return words + kHeader + experts * (1 + blocks_per_expert) + id; }
    __device__ u32* state(u32 id) const { return landed(id) + blocks; }
    __device__ u32* expert_of(u32 id) const { return landed(id) + 2 * blocks; }
    __device__ u32* wave_ids() const { return landed(0) + 3 * blocks; }
};

// RESERVE + ALLOCATE (or WAIT) for one choice of local expert e; one lane. Returns the pool row
// (id * bm + offset), or kNoRow after recording an overflow (defence in depth: the pool is sized by
// padded_rows_bound, which holds while each source brings at most N rows; PROTOCOL.md "Capacity").
__device__ __forceinline__ u32 reserve_row(const RingDesc& d, const Pool& pool, u32 e) {
    // NOTES: relaxed - a reservation orders nothing; the row's LAND is its release.
    const u32 r = atomicAdd(pool.reserve(e), 1u);
    const u32 j = r / pool.block_m, offset = r % pool.block_m;
    if (j >= pool.blocks_per_expert) {
        protocol::record_error(d, ErrorCode::kInternal, Site::kBlocks, e, j, pool.blocks_per_expert, r);
        return kNoRow;
    }
    u32 id;
    if (offset == 0) {
        id = atomicAdd(pool.counter(kPoolNext), 1u);  // NOTES: relaxed - an index, not a hand-off
        if (id >= pool.blocks) {
            protocol::record_error(d, ErrorCode::kInternal, Site::kBlocks, e, id, pool.blocks, id);
            return kNoRow;
        }
        // The label before the id is published: the claimant reads it after acquiring the block's seal,
        // which is after this lane's own LAND (this lane reserved the block's row 0), so it sees it.
        *pool.expert_of(id) = e;
        ptx::st_relaxed_gpu(pool.block_of(e, j), id + 1);  // NOTES: relaxed - waiters need only the id
    } else {
        // The allocating lane reserved offset 0 before us and allocates right after its reservation,
        // waiting for nothing in between: the wait is short and cannot be part of a cycle.
        u32 published = 0;
        if (!protocol::spin_until(d, Site::kWaitAllocation, d.my_pe, e, 1, [&](u64& observed) {
                published = ptx::ld_relaxed_gpu(pool.block_of(e, j));
                observed = published;
                return published != 0 ? 1 : 0;
            }))
            return kNoRow;
        id = published - 1;
        if (id >= pool.blocks) return kNoRow;  // its allocator recorded the overflow
    }
    if constexpr (protocol::kMutant == protocol::Mutant::kSealOnReserve) {
        // The mutant: the reservation of a block's last row seals it, before any of its rows landed.
        if (offset == pool.block_m - 1) {
            ptx::st_relaxed_gpu(pool.state(id), kSealedBit | pool.block_m);
            atomicAdd(pool.counter(kSealed), 1u);
        }
    }
    return id * pool.block_m + offset;
}

// LAND one stored row (pool row `row`), and SEAL ITS BLOCK if it completed it; one lane, after a
// __syncwarp that follows every store of the row by its warp (the barrier puts them before the fence).
__device__ __forceinline__ void land_row(const Pool& pool, u32 row) {
    const u32 id = row / pool.block_m;
    // release: the fence, then the arrival (fence + relaxed RMW), cumulative over the warp's stores.
    ptx::fence_acq_rel_gpu();
    const u32 old = atomicAdd(pool.landed(id), 1u);
    if constexpr (protocol::kMutant != protocol::Mutant::kSealOnReserve) {
        if (old + 1 == pool.block_m) {
            // acquire: the RMW chain on landed[id] brings every earlier lander's release; the fence makes
            // them this lane's before the seal, and - with the relaxed store after it - is the seal's release.
            ptx::fence_acq_rel_gpu();
            ptx::st_relaxed_gpu(pool.state(id), kSealedBit | pool.block_m);
            atomicAdd(pool.counter(kSealed), 1u);  // NOTES: relaxed - a hint for the waves' wait, not a hand-off
        }
    }
}

// END OF EVERY SOURCE at one pull block, and SEAL THE PARTIAL BLOCKS if it is the last: thread 0, after
// a __syncthreads that follows every LAND of the block (so its fence is cumulative over them).
__device__ __forceinline__ void end_of_streams(const RingDesc& d, const Pool& pool) {
    ptx::fence_acq_rel_gpu();  // release of this block's landings (the partial blocks' sealer reads landed[])
    const u32 old = atomicAdd(pool.counter(kEnded), 1u);
    if (old + 1 != gridDim.x) return;
    // The finisher: every pull block ended every source, so every reservation is final and every
    // reserved row has landed. acquire: the RMW chain on kEnded brings every block's release.
    ptx::fence_acq_rel_gpu();
    // NOTES: relaxed loads below - every word was last written before a release that the fence acquired.
    for (u32 e = 0; e < pool.experts; ++e) {
        const u32 c = min(ptx::ld_relaxed_gpu(pool.reserve(e)), pool.blocks_per_expert * pool.block_m);
        const u32 n = c % pool.block_m;
        if (n == 0) continue;  // every block of e is full: each was sealed by its last lander
        const u32 id = ptx::ld_relaxed_gpu(pool.block_of(e, c / pool.block_m)) - 1;
        if (id >= pool.blocks) continue;  // an overflow, recorded at its allocation
        const u32 landed = ptx::ld_relaxed_gpu(pool.landed(id));
        if (landed != n) protocol::record_error(d, ErrorCode::kInternal, Site::kBlocks, e, id, n, landed);
        ptx::st_relaxed_gpu(pool.state(id), kSealedBit | n);  // released by the fence above, as a seal
        atomicAdd(pool.counter(kSealed), 1u);
    }
    // release: after every partial seal; a claimant that acquires it finds every block sealed.
    ptx::st_release_gpu(pool.counter(kSealedAll), 1u);
}

}  // namespace chunkring::moe::blocks
