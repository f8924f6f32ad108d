// The persistent decode consumer's work and where it lives (device/kernels/moe_persistent.cu runs it;
// runtime/chunkring/moe/_engine/persistent.py launches it and mirrors the shared-memory layout below).
//
// The work of one call: for every local expert with rows (the plan's groups, moe_plan_scatter), L1 + SwiGLU + FP8
// quantisation and L2, as "units" of 128 x K weight bytes per 16 KB stage row-block:
//   L1 unit (expert, chunk)     intermediate columns [128 chunk, 128 chunk + 128): their 128 gate and 128 up rows of
//                               w13, in two halves of 64 columns; one 1x128 scale block of the activation, so the
//                               unit quantises its own rows' activations (no other unit holds part of the block)
//   L2 unit (expert, row block) output columns [128 rb, 128 rb + 128): 128 rows of w2
// A unit runs over its expert's rows in passes of at most `tile_cap` rows, each pass one token tile of N = 8, 16, 32
// or 64 (the smallest that holds its rows); a pass streams the unit's weights again (the unit's passes run back
// to back on one block, so a second pass finds them in the L2 cache).
//
// A pass is a sequence of steps, each one weight tile of 128 rows x 128 k (16 KB, one k block) and the pass's token
// tile for the same k block: L1 passes take 2 halves x H / 128 steps, L2 passes I / 128. Three roles walk the same
// steps in the same order, each from this header alone: the weight loader (bulk tensor copies into a ring of
// `stages` weight stages), the token loader (the token rows and their scales into a ring of `token_stages` token
// stages) and the two math warpgroups, which consume both rings in step.
//
// The units of a call form one list, every L1 unit before every L2 unit (an L2 unit waits for its expert's L1 units:
// moe_persistent.cu's `sync` counters), and each block takes its units from it in list order (`claim`). A static
// claim (strided, blocked) gives every block its units up front: the smallest unfinished unit of the call never
// waits for one after it, so the call finishes as long as every block is resident at once (one block per SM, at most
// the SMs' count of blocks). The dynamic claim hands out the list in order from one ticket per launch, to whichever
// block asks next: every unit before a taken one is already taken - by a block that is running - and an L1 unit waits
// for nothing but its own block's earlier units, all of them L1 units, so every wait ends without any residency.
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/ptx/ordering.cuh"
#include "chunkring/util/stage_pipeline.cuh"

namespace chunkring::moe::persistent {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

constexpr u32 kWarp = 32;
constexpr u32 kMathWarps = 8;                       // two warpgroups
constexpr u32 kMathThreads = kMathWarps * kWarp;
constexpr u32 kThreads = kMathThreads + 128;        // + the loaders' warpgroup
constexpr u32 kWeightLoaderWarp = kMathWarps;       // its first warp: the weight loader
constexpr u32 kTokenLoaderWarp = kMathWarps + 1;    // its second: the token loader (the other two idle)
// Registers per thread after the warpgroups trade: 128 x 56 + 256 x 224 <= 384 x 168. The loaders need 56 (at the
// weight-read probe's 40 they spilled); the math fits 224 without spills with token tiles of at most 64.
constexpr int kLoaderRegisters = 56, kMathRegisters = 224;
static_assert(128 * kLoaderRegisters + kMathThreads * kMathRegisters <= 65536, "one block per SM");

constexpr u32 kKBlock = 128;                        // k per step: one 128x128 weight scale block, one 1x128 row scale
constexpr u32 kTileRows = 128;                      // weight rows per step (64 per math warpgroup)
constexpr u32 kWeightStageBytes = kTileRows * kKBlock;  // 16 KB
constexpr u32 kTokenBoxRows = 8;                    // token rows per bulk tensor copy (one 1 KB swizzle atom)
constexpr u32 kW13Groups = 16;                      // an L1 tile's 8-row groups (w13_boxes 16: one copy each)
constexpr u32 kMaxTile = 64;                        // the widest token tile (wgmma N): more rows take more passes
constexpr u32 kMaxExperts = 256;                    // local experts a call may have (the active list's room)
constexpr u32 kMaxTokenStages = 8;
constexpr u32 kStageAlign = 1024;                   // a 128-byte-swizzled copy's destination boundary

// Variants chosen at run time (append-only codes, persistent.py mirrors them).
constexpr int kStridedExperts = 0;  // claim: units u = block, block + grid, ...; each expert's units consecutive
constexpr int kStridedBlocks = 1;   // claim: strided; consecutive units are different experts' (block-major)
constexpr int kBlocked = 2;         // claim: one contiguous share of the list per block, expert-major
constexpr int kDynamic = 3;         // claim: the list in order, each unit to the block that takes the next ticket
constexpr int kPhaseL1 = 1, kPhaseL2 = 2, kPhaseBoth = 3;  // phases: bit 0 the L1 units, bit 1 the L2 units
constexpr u32 kL1 = 0, kL2 = 1;     // a unit's GEMM

// The token tile of a pass of `rows` rows (1 .. kMaxTile): the smallest wgmma N that holds them.
constexpr __host__ __device__ u32 tile_for(u32 rows) { return rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 32 ? 32 : 64; }
static_assert(tile_for(1) == 8 && tile_for(8) == 8 && tile_for(9) == 16 && tile_for(33) == 64 && tile_for(64) == 64,
              "token tiles");

// The block's dynamic shared memory, from a kStageAlign boundary (the launch adds kStageAlign bytes of slack):
// weight stages, token tiles, token scales, the L1 epilogue's per-warp absmax; offsets in bytes.
struct SharedLayout {
    u32 weights, tokens, token_scales, amax, bytes;
};

constexpr __host__ __device__ SharedLayout shared_layout(u32 stages, u32 token_stages, u32 tile_cap) {
    const u32 tokens = stages * kWeightStageBytes;
    const u32 token_scales = tokens + token_stages * tile_cap * kKBlock;  // tiles of whole 1 KB atoms
    const u32 amax = token_scales + token_stages * tile_cap * 4;
    return SharedLayout{0, tokens, token_scales, amax, amax + kMathWarps * tile_cap * 4};
}

// The bytes a launch gives: the layout and its alignment slack (persistent.py shared_bytes mirrors it).
constexpr __host__ __device__ u32 launch_shared_bytes(u32 stages, u32 token_stages, u32 tile_cap) {
    return shared_layout(stages, token_stages, tile_cap).bytes + kStageAlign;
}
static_assert(launch_shared_bytes(8, 4, 64) == 167936, "pinned: persistent.py");
static_assert(launch_shared_bytes(10, 4, 64) == 200704 && launch_shared_bytes(12, 3, 32) == 211328,
              "pinned: persistent.py");

// Faults. Every wait of the kernel is bounded, and a block that gives up - or finds its arguments out of range -
// leaves one word saying what it waited for, then traps. The word goes to host memory (the launch's `fault_record`:
// a pinned host buffer's address, 0 for none), which a trap does not take away with the context; persistent.py
// decodes it (fault_of). NOTES: no printf - ptxas serialises every WGMMA of a kernel that holds a call anywhere
// (warning C7510), and printf is one; DeepGEMM's WGMMA kernels trap without printing too. One packed word, not a
// record of several: each wait site inlines the write, and wider ones cost the math warpgroups registers (spills).
//   bits 0-7 kind, 8-19 block, 20-29 thread, 30 parity, 31-46 what (a stage, or an expert), 47-62 seen (a count)
// What a block waited for (append-only, persistent.py FAULT_KINDS); never 0, so a written word is never 0.
constexpr u32 kFaultArguments = 1, kFaultGroupStart = 2, kFaultWeightSlot = 3, kFaultTokenSlot = 4,
              kFaultWeightStage = 5, kFaultTokenStage = 6, kFaultL1Units = 7, kFaultClaimSlot = 9,
              kFaultClaim = 10;

constexpr __host__ __device__ u64 fault_word(u32 kind, u32 block, u32 thread, u32 parity, u32 what, u32 seen) {
    return static_cast<u64>(kind & 0xffu) | static_cast<u64>(block & 0xfffu) << 8 |
           static_cast<u64>(thread & 0x3ffu) << 20 | static_cast<u64>(parity & 1u) << 30 |
           static_cast<u64>(what & 0xffffu) << 31 | static_cast<u64>(seen & 0xffffu) << 47;
}
static_assert(fault_word(5, 131, 200, 1, 7, 0) == 0x3cc808305ull &&
                  fault_word(7, 0, 0, 0, 31, 15) == 0x7800f80000007ull,
              "pinned: persistent.py fault_of");

struct Watch {
    u64 record;    // the fault word's address, 0 for none
    u64 limit_ns;  // how long a wait may take
};

// Writes the fault word (system scope: the host reads it) and traps.
__device__ __forceinline__ void raise_fault(const Watch& w, u32 kind, u32 what, u32 parity, u32 seen) {
    if (w.record != 0) {
        ptx::st_relaxed_sys(reinterpret_cast<u64*>(w.record),
                            fault_word(kind, blockIdx.x, threadIdx.x, parity, what, seen));
        ptx::fence_acq_rel_sys();
    }
    __trap();
}

// How a stage wait of the kernel gives up (util::StagePipeline's acquire and wait, for at most watch.limit_ns): the
// fault word of `kind` naming the stage and its parity, then a trap.
struct StageFault {
    const Watch& watch;
    u32 kind;
    __device__ __forceinline__ void operator()(u32 stage, u32 parity, u64) const {
        raise_fault(watch, kind, stage, parity, 0);
    }
};

// The experts with rows, ascending, with their groups (in static shared memory; built once per block).
struct Active {
    u32 count;
    u32 expert[kMaxExperts];
    u32 first[kMaxExperts];  // the group's first row of the plan
    u32 rows[kMaxExperts];
};

// Warp-wide (every lane of one warp): `active` from the plan's counts and group ends (group e is rows
// [group_end[e] - counts[e], group_end[e])). The counts are final: the plan's kernels ran before this one.
__device__ __forceinline__ void build_active(Active& active, const unsigned* counts, const int* group_end,
                                             u32 experts, const Watch& w) {
    const u32 lane = threadIdx.x % kWarp;
    u32 found = 0;
    for (u32 base = 0; base < experts; base += kWarp) {
        const u32 e = base + lane;
        const u32 rows = e < experts ? counts[e] : 0;
        const u32 mask = __ballot_sync(0xffffffffu, rows > 0);
        if (rows > 0) {
            const u32 at = found + __popc(mask & ((1u << lane) - 1)), first = static_cast<u32>(group_end[e]) - rows;
            // the token loader copies whole 8-row boxes and their scales
            if (first % kTokenBoxRows != 0) raise_fault(w, kFaultGroupStart, e, 0, first);
            active.expert[at] = e;
            active.rows[at] = rows;
            active.first[at] = first;
        }
        found += __popc(mask);
    }
    if (lane == 0) active.count = found;
}

// One unit of the list, resolved.
struct Unit {
    u32 gemm;    // kL1 or kL2
    u32 expert;  // its local expert
    u32 block;   // L1: the 128-column chunk of the intermediate; L2: the 128-row block of w2 (output columns)
    u32 first;   // the expert's first plan row
    u32 rows;    // and its row count
};

// One pass of a unit: plan rows [row0, row0 + rows), token tile `tile`.
struct Pass {
    u32 row0, rows, tile;
};

// The call's shapes and the list's order, the same in every role of every block.
struct Schedule {
    u32 hidden, inter;
    u32 tile_cap;
    u32 l1_units, total;  // L1 units first, then L2 units
    u32 active;
    int claim;

    __device__ __forceinline__ u32 chunks() const { return inter / kKBlock; }        // L1 units an expert
    __device__ __forceinline__ u32 row_blocks() const { return hidden / kTileRows; }  // L2 units an expert
    __device__ __forceinline__ u32 kblocks(u32 gemm) const { return (gemm == kL1 ? hidden : inter) / kKBlock; }
    // The 64-column halves of a pass's steps (L2: one)
    __device__ __forceinline__ u32 halves(u32 gemm) const { return gemm == kL1 ? 2 : 1; }
    // How many quantised L1 passes release an expert of `rows` rows to its L2 units: one per chunk and pass.
    __device__ __forceinline__ u32 l1_releases(u32 rows) const { return chunks() * ((rows + tile_cap - 1) / tile_cap); }
    __device__ __forceinline__ u32 passes(const Unit& u) const { return (u.rows + tile_cap - 1) / tile_cap; }

    __device__ __forceinline__ Pass pass(const Unit& u, u32 p) const {
        const u32 done = p * tile_cap, rows = min(u.rows - done, tile_cap);
        return Pass{u.first + done, rows, tile_for(rows)};
    }

    // This block's first unit and the one after `u` (`total` past its last).
    __device__ __forceinline__ u32 blocked_begin(u32 block) const {
        return static_cast<u32>(static_cast<u64>(total) * block / gridDim.x);
    }
    __device__ __forceinline__ u32 first_unit() const {
        return claim == kBlocked ? blocked_begin(blockIdx.x) : blockIdx.x;
    }
    __device__ __forceinline__ u32 next_unit(u32 u) const {
        if (claim != kBlocked) return u + gridDim.x;
        return u + 1 < blocked_begin(blockIdx.x + 1) ? u + 1 : total;
    }

    // Unit `u` (< total) of the list.
    __device__ __forceinline__ Unit unit(u32 u, const Active& a) const {
        const u32 gemm = u < l1_units ? kL1 : kL2;
        const u32 within = gemm == kL1 ? u : u - l1_units;
        const u32 per = gemm == kL1 ? chunks() : row_blocks();
        const u32 slot = claim == kStridedBlocks ? within % active : within / per;
        const u32 block = claim == kStridedBlocks ? within / active : within % per;
        return Unit{gemm, a.expert[slot], block, a.first[slot], a.rows[slot]};
    }
};

__device__ __forceinline__ Schedule make_schedule(const Active& a, u64 hidden, u64 inter, u32 tile_cap, int claim,
                                                  int phases) {
    Schedule s{static_cast<u32>(hidden), static_cast<u32>(inter), tile_cap, 0, 0, a.count, claim};
    s.l1_units = (phases & kPhaseL1) ? a.count * s.chunks() : 0;
    s.total = s.l1_units + ((phases & kPhaseL2) ? a.count * s.row_blocks() : 0);
    return s;
}

// The dynamic claim's hand-over inside a block: the weight loader takes each unit from the launch's ticket (one relaxed
// add: the ticket orders the claims, nothing is published through it) and passes it on through a ring of
// kClaimDepth slots to the token loader and the math warps, so that all three walk the same units; it claims at most
// kClaimDepth units ahead of the slowest of them. The unit past the last (`total`) ends every walk.
constexpr u32 kClaimDepth = 4;
constexpr u32 kClaimConsumers = kMathWarps + 1;  // the math warps and the token loader's warp

struct Claims {
    util::StagePipeline pipe;  // its stages are the slots; commit(0) publishes a slot's unit
    u32 unit[kClaimDepth];
};

// One role's walk over its block's units: first(), then next(i) until it returns s.total. A static claim's from the
// schedule alone; a dynamic one's through `claims`, the weight loader's thread taking (kTake: from `ticket`) and every
// other role following whole warps at a time (each warp's lane 0 releases the slot once the warp has read it).
template <bool kTake>
struct UnitWalk {
    Claims* claims;
    unsigned* ticket;  // kTake only
    u32 taken = 0;     // hand-overs so far: the next one's slot and the parity of its lap

    __device__ __forceinline__ u32 first(const Schedule& s, const Watch& w) {
        return s.claim == kDynamic ? hand_over(s, w) : s.first_unit();
    }
    __device__ __forceinline__ u32 next(u32 i, const Schedule& s, const Watch& w) {
        return s.claim == kDynamic ? hand_over(s, w) : s.next_unit(i);
    }

  private:
    __device__ __forceinline__ u32 hand_over(const Schedule& s, const Watch& w) {
        const util::Cursor c{taken % kClaimDepth, (taken / kClaimDepth) & 1};
        ++taken;
        u32 i;
        if constexpr (kTake) {
            claims->pipe.acquire(c, w.limit_ns, StageFault{w, kFaultClaimSlot});
            i = min(atomicAdd(ticket, 1u), s.total);
            claims->unit[c.stage] = i;
            claims->pipe.commit(c, 0);  // release: the slot's unit is seen by the consumers' wait
        } else {
            claims->pipe.wait(c, w.limit_ns, StageFault{w, kFaultClaim});
            i = claims->unit[c.stage];
            __syncwarp();  // every lane has read the slot before it is released
            if (threadIdx.x % kWarp == 0) claims->pipe.release(c);
        }
        return i;
    }
};

}  // namespace chunkring::moe::persistent
