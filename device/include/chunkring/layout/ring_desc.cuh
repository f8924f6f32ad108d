// The ring descriptor: where every region of a rank's ring buffer lives. Built by the host
// (runtime/chunkring/ring/layout.py computes every offset, in one place); the device only reads it.
// Field list and order mirror runtime/chunkring/ring/layout.py DESC_FIELDS (tests/unit/test_layout.py compares them).
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::layout {

using u64 = ::cuda::std::uint64_t;

constexpr u64 kRingLayoutVersion = 4;  // == runtime/chunkring/ring/layout.py LAYOUT_VERSION

struct RingDesc {
    u64 layout_version;   // kRingLayoutVersion
    u64 desc_bytes;       // sizeof(RingDesc), as the host computed it
    u64 world_size;
    u64 my_pe;
    u64 num_slots;
    u64 tokens_per_slot;
    u64 hidden;
    u64 topk;
    u64 num_experts;
    u64 payload_format;   // runtime/chunkring/ring/spec.py PayloadFormat: 0 FP8 e4m3 + fp32 scales, 1 bf16
    u64 epoch_bits;       // high bits of a generation holding the epoch
    u64 timeout_ns;       // a spin-wait longer than this reports who is stuck
    u64 base;             // this PE's ring buffer (a symmetric address: same offset on every PE)
    u64 off_x;
    u64 off_x_sf;
    u64 off_topk_idx;
    u64 off_topk_weights;
    u64 off_meta;
    u64 off_route_ready;
    u64 off_layout_ready;
    u64 off_ack;
    u64 off_consumed;
    u64 off_cursor;
    u64 off_control;
    u64 off_status;
    u64 x_row_bytes;
    u64 x_sf_row_floats;
    u64 ready_row_words;
    u64 ack_slot_words;
    u64 total_bytes;
    u64 rma_peers;        // bit pe set: read pe's slots and write its combine rows by NVSHMEM RMA, not loads/stores
    u64 failure_word;     // a mapped pinned host word the first recorded error is copied into (0: none), so the host
                          // learns of it without synchronising (protocol/status.cuh record_error)
};
static_assert(sizeof(RingDesc) == 32 * sizeof(u64), "RingDesc must match runtime/chunkring/ring/layout.py DESC_FIELDS");

// Word indices inside the control, status and meta regions (runtime/chunkring/ring/layout.py CONTROL, STATUS, META).
enum ControlWord : u64 { kControlEpoch = 0, kControlNextSeq = 1 };
enum StatusWord : u64 {
    kStatusCode = 0, kStatusPe = 1, kStatusPeer = 2, kStatusSlot = 3,
    kStatusExpected = 4, kStatusObserved = 5, kStatusSite = 6, kStatusCount = 7,
    // The first malformed input a consumer masked (protocol/validate.cuh): not an error of the protocol.
    kStatusInputField = 8, kStatusInputSource = 9, kStatusInputSlot = 10, kStatusInputRow = 11,
    kStatusInputColumn = 12, kStatusInputValue = 13,
    kStatusInputCount = 14,
    // The abort word: the first error any rank of this ring recorded in the epoch, written by that rank
    // into every rank's word (protocol/status.cuh raise_abort); 0 while none has.
    kStatusAbort = 15,
    // The abort notice: any rank's error, sent without waiting for delivery before the abort word's fetching
    // compare-and-swaps, so a peer stuck behind an unreachable one still stops (raise_abort); 0 while none has.
    kStatusAbortNotice = 16,
};
enum MetaWord : u64 { kMetaTokenBase = 0, kMetaNumTokens = 1, kMetaFlags = 2, kMetaWords = 4 };
constexpr u64 kMetaEndOfStream = 1;

template <typename T>
__device__ __forceinline__ T* region(const RingDesc& d, u64 offset) {
    return reinterpret_cast<T*>(d.base + offset);
}

// Typed addresses of one slot's parts in THIS PE's buffer; being symmetric, they also name the
// same slot on any peer (pass them to NVSHMEM with that peer's PE, or to nvshmem_ptr).
__device__ __forceinline__ unsigned char* slot_x(const RingDesc& d, u64 slot) {
    return region<unsigned char>(d, d.off_x) + slot * d.tokens_per_slot * d.x_row_bytes;
}
__device__ __forceinline__ float* slot_x_sf(const RingDesc& d, u64 slot) {
    return region<float>(d, d.off_x_sf) + slot * d.tokens_per_slot * d.x_sf_row_floats;
}
__device__ __forceinline__ int* slot_topk_idx(const RingDesc& d, u64 slot) {
    return region<int>(d, d.off_topk_idx) + slot * d.tokens_per_slot * d.topk;
}
__device__ __forceinline__ float* slot_topk_weights(const RingDesc& d, u64 slot) {
    return region<float>(d, d.off_topk_weights) + slot * d.tokens_per_slot * d.topk;
}
__device__ __forceinline__ u64* slot_meta(const RingDesc& d, u64 slot) {
    return region<u64>(d, d.off_meta) + slot * kMetaWords;
}
__device__ __forceinline__ u64* route_ready_word(const RingDesc& d, u64 src, u64 slot) {
    return region<u64>(d, d.off_route_ready) + src * d.ready_row_words + slot;
}
__device__ __forceinline__ u64* layout_ready_word(const RingDesc& d, u64 src, u64 slot) {
    return region<u64>(d, d.off_layout_ready) + src * d.ready_row_words + slot;
}
// Destination `dest`'s ack word of `slot` (rules.cuh: one word per destination, holding a generation).
__device__ __forceinline__ u64* ack_word(const RingDesc& d, u64 slot, u64 dest) {
    return region<u64>(d, d.off_ack) + slot * d.ack_slot_words + dest;
}
__device__ __forceinline__ u64* consumed_word(const RingDesc& d, u64 slot) { return region<u64>(d, d.off_consumed) + slot; }
__device__ __forceinline__ u64* cursor_word(const RingDesc& d, u64 src) { return region<u64>(d, d.off_cursor) + src; }
__device__ __forceinline__ u64* control_word(const RingDesc& d, ControlWord w) { return region<u64>(d, d.off_control) + w; }
__device__ __forceinline__ u64* status_word(const RingDesc& d, StatusWord w) { return region<u64>(d, d.off_status) + w; }

}  // namespace chunkring::layout
