// The producer's side of one chunk beyond begin_chunk: how many rows it carries (a device token count
// may cut it short), and its close - metadata, both ready words, the cursor. Shared by every kernel
// that publishes: the host API's copy of torch tensors (ring_host_api.cu) and the MoE layer's fused
// producer (moe_produce.cu).
#pragma once

#include "chunkring/protocol/ring.cuh"
#include "chunkring/protocol/validate.cuh"

namespace chunkring::protocol {

struct ChunkExtent {
    u64 n;         // rows this chunk carries
    bool eos;      // it ends the stream
    bool publish;  // false: wholly past the real count, nothing is published
};

// valid_tokens (nullable): the batch's real token count, read at run time - a CUDA graph captured with
// fixed shapes replays with whatever count the caller wrote. The chunk then carries only the rows below
// it and ends the stream if it reaches it; a chunk wholly past it publishes nothing (its stream already
// ended), except the first, which an empty rank still publishes, empty. A count outside [0, batch_rows]
// is clamped and reported (validate.cuh), never used as an index; `report`: this kernel reports it.
// Every kernel of one publish computes the same extent from the same inputs.
__device__ inline ChunkExtent chunk_extent(const RingDesc& d, int n_tokens, long long token_base, int end_of_stream,
                                           const int* valid_tokens, long long batch_rows, bool report) {
    ChunkExtent e{static_cast<u64>(n_tokens), end_of_stream != 0, true};
    if (valid_tokens == nullptr) return e;
    const long long asked = *valid_tokens;
    const long long valid = asked < 0 ? 0 : (asked > batch_rows ? batch_rows : asked);
    if (report && asked != valid && threadIdx.x == 0 && token_base == 0)  // once per call, by its first chunk
        report_input(d, InputField::kValidTokens, d.my_pe, 0, 0, 0, static_cast<u64>(asked));
    if (token_base > 0 && token_base >= valid) return {0, false, false};
    const u64 left = static_cast<u64>(valid - token_base);
    e.n = left < e.n ? left : e.n;
    e.eos = token_base + static_cast<long long>(n_tokens) >= valid;
    return e;
}

// Metadata, both ready words, the producer's cursor: the chunk is out. The slot's rows must be written
// before this (by this block, or by others whose stores happen-before it: stream order, or an arrival
// count released and acquired at GPU scope); publish's system-scope release fence covers them all.
__device__ inline void close_chunk(const RingDesc& d, u64 epoch, u64 seq, const ChunkExtent& e, long long token_base) {
    const u64 slot = slot_of(seq, d.num_slots);
    if (threadIdx.x == 0) {
        u64* meta = slot_meta(d, slot);
        meta[kMetaTokenBase] = static_cast<u64>(token_base);
        meta[kMetaNumTokens] = e.n;
        meta[kMetaFlags] = e.eos ? kMetaEndOfStream : 0;
    }
    publish(d, epoch, seq, ReadyKind::kRoute);
    publish(d, epoch, seq, ReadyKind::kLayout);
    end_chunk(d, seq);
}

// NOTES: relaxed - only this rank's producers write next_seq, and they are stream-ordered.
__device__ __forceinline__ u64 next_seq(const RingDesc& d) { return ptx::ld_relaxed_sys(control_word(d, kControlNextSeq)); }

}  // namespace chunkring::protocol
