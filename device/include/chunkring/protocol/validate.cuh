// What a consumer checks before it trusts a value read from a slot as an index, a count or a scale.
// Producers chunkring does not control (a user's router, a buggy TopK, a half-initialised buffer) write
// these; a consumer that trusted them could read or write out of bounds - in another GPU's memory.
//
// Every check masks by one documented rule and reports the first masked value per rank (field, source,
// slot, row, column, raw value; plus a count) in the status region's input words, which the host raises
// as ChunkringInputError (runtime/chunkring/ring/status.py). A masked input is not a protocol error: the call still
// acknowledges every chunk and completes, so no peer waits and nothing hangs; its output for the masked
// values follows the rule below.
//   TOPK_IDX    outside [-1, num_experts) ........ the choice is masked (read as -1)
//   X_SF        NaN or infinite .................. the scale is read as 0 (that block adds nothing)
//   NUM_TOKENS  above tokens_per_slot ............ the chunk is read as empty (its stream still ends
//   TOKEN_BASE  base + count beyond the output ... the chunk is read as empty  if it says so)
//               (incremental pull) base before the source's previous chunk's end: read as empty
//   VALID_TOKENS (producer side) outside [0, batch rows] ... clamped into that range
#pragma once

#include "chunkring/layout/ring_desc.cuh"
#include "chunkring/protocol/mutants.cuh"
#include "chunkring/protocol/rules.cuh"
#include "chunkring/protocol/status.cuh"

namespace chunkring::protocol {

using layout::RingDesc;

// Append-only; mirrored by runtime/chunkring/ring/status.py InputField.
enum class InputField : unsigned long long {
    kNone = 0, kTopkIdx = 1, kXSf = 2, kNumTokens = 3, kTokenBase = 4, kValidTokens = 5,
};

__device__ __noinline__ void report_input(const RingDesc& d, InputField field, u64 source, u64 slot, u64 row,
                                          u64 column, u64 value) {
    using namespace layout;
    if (!claim_first_record(d, kStatusInputCount, kStatusInputField, static_cast<u64>(field))) return;
    *status_word(d, kStatusInputSource) = source;
    *status_word(d, kStatusInputSlot) = slot;
    *status_word(d, kStatusInputRow) = row;
    *status_word(d, kStatusInputColumn) = column;
    *status_word(d, kStatusInputValue) = value;
}

// Rows of a chunk the consumer may read: `n` if the chunk fits a slot and, at `base`, an output of
// `capacity` rows; otherwise 0 (reported if `report`: when every thread checks, one reports).
__device__ __forceinline__ u64 checked_chunk_rows(const RingDesc& d, u64 src, u64 slot, u64 base, u64 n, u64 capacity,
                                                  bool report = true) {
    if constexpr (kMutant == Mutant::kNoInputChecks) return n;
    if (n > d.tokens_per_slot) {
        if (report) report_input(d, InputField::kNumTokens, src, slot, 0, 0, n);
        return 0;
    }
    if (base > capacity || n > capacity - base) {
        if (report) report_input(d, InputField::kTokenBase, src, slot, 0, 0, base);
        return 0;
    }
    return n;
}

// Rows of a non-empty chunk whose rows must not overlap its source's earlier chunks of the call (the
// incremental pull reserves a pool row per choice, and its pool holds N rows per source: docs/PROTOCOL.md,
// "Capacity and overflow"): `n` if `base` is at or past `next_base` (the previous chunk's base + count),
// otherwise 0 - the chunk read as empty, reported as TOKEN_BASE (column: next_base).
__device__ __forceinline__ u64 checked_chunk_order(const RingDesc& d, u64 src, u64 slot, u64 base, u64 n,
                                                   u64 next_base, bool report = true) {
    if constexpr (kMutant == Mutant::kNoInputChecks) return n;
    if (n == 0 || base >= next_base) return n;
    if (report) report_input(d, InputField::kTokenBase, src, slot, 0, next_base, base);
    return 0;
}

// A top-k choice: an expert in [0, num_experts), or -1 (masked; out-of-range values are reported).
__device__ __forceinline__ int checked_expert(const RingDesc& d, u64 src, u64 slot, u64 row, u64 k, int expert) {
    if constexpr (kMutant == Mutant::kNoInputChecks) return expert;
    if (expert >= -1 && static_cast<long long>(expert) < static_cast<long long>(d.num_experts)) return expert;
    report_input(d, InputField::kTopkIdx, src, slot, row, k, static_cast<u64>(static_cast<long long>(expert)));
    return -1;
}

// An FP8 block scale: finite, or 0 (reported, if `report`: a kernel that reads a scale more than once reports it
// once).
__device__ __forceinline__ float checked_scale(const RingDesc& d, u64 src, u64 slot, u64 row, u64 column, float scale,
                                               bool report = true) {
    if constexpr (kMutant == Mutant::kNoInputChecks) return scale;
    if (isfinite(scale)) return scale;
    if (report) report_input(d, InputField::kXSf, src, slot, row, column, __float_as_uint(scale));
    return 0.0f;
}

}  // namespace chunkring::protocol
