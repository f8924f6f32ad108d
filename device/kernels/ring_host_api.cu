// Kernels behind the host-side ring API (runtime/ring/io.py publish_chunk / gather):
// a torch producer fills tensors and publishes them as the next chunk, stream-ordered; a consumer
// gathers every chunk of one invocation from every source into dense per-source outputs.
// Both go through the device API of protocol/ring.cuh; neither takes a host-supplied generation.
#include "chunkring/protocol/ring.cuh"
#include "chunkring/protocol/validate.cuh"
#include "chunkring/util/copy.cuh"
#include "chunkring/util/kernel_params.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
using chunkring::util::block_copy16;
using chunkring::util::block_copy4;

// Publish rows [0, n_tokens) of the given tensors as this rank's next chunk, rows
// [token_base, token_base + n_tokens) of its batch. One block.
// x: [n, hidden] payload bytes; x_sf: [n, hidden/128] fp32 (FP8 only); topk_idx/topk_weights: [n, topk].
//
// valid_tokens (nullable): the batch's real token count, read here at run time - a CUDA graph
// captured with fixed shapes replays with whatever count the caller wrote. The chunk then carries
// only the rows below it and ends the stream if it reaches it; a chunk wholly past it publishes
// nothing (its stream already ended), except the first, which an empty rank still publishes, empty.
// A count outside [0, batch_rows] is clamped and reported (protocol/validate.cuh), never used as an index.
extern "C" __global__ void ring_publish_tensors(const RingDesc* desc, const unsigned char* x, const float* x_sf,
                                                const int* topk_idx, const float* topk_weights, int n_tokens,
                                                long long token_base, int end_of_stream,
                                                CHUNKRING_NULLABLE const int* valid_tokens, long long batch_rows) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    u64 n = static_cast<u64>(n_tokens);
    bool eos = end_of_stream != 0;
    if (valid_tokens != nullptr) {
        const long long asked = *valid_tokens;
        const long long valid = asked < 0 ? 0 : (asked > batch_rows ? batch_rows : asked);
        if (asked != valid && threadIdx.x == 0 && token_base == 0)  // reported once per call, by its first chunk
            report_input(d, InputField::kValidTokens, d.my_pe, 0, 0, 0, static_cast<u64>(asked));
        if (token_base > 0 && token_base >= valid) return;  // block-uniform
        const u64 left = static_cast<u64>(valid - token_base);
        n = left < n ? left : n;
        eos = token_base + static_cast<long long>(n_tokens) >= valid;
    }
    const u64 epoch = current_epoch(d);
    // NOTES: relaxed - only this rank's producers write next_seq, and they are stream-ordered.
    const u64 seq = ptx::ld_relaxed_sys(control_word(d, kControlNextSeq));
    if (!begin_chunk(d, epoch, seq)) return;
    const u64 slot = slot_of(seq, d.num_slots);
    block_copy4(slot_topk_idx(d, slot), topk_idx, n * d.topk);
    block_copy4(slot_topk_weights(d, slot), topk_weights, n * d.topk);
    if (threadIdx.x == 0) {
        u64* meta = slot_meta(d, slot);
        meta[kMetaTokenBase] = static_cast<u64>(token_base);
        meta[kMetaNumTokens] = n;
        meta[kMetaFlags] = eos ? kMetaEndOfStream : 0;
    }
    publish(d, epoch, seq, ReadyKind::kRoute);
    block_copy16(slot_x(d, slot), x, n * d.x_row_bytes);
    block_copy4(slot_x_sf(d, slot), x_sf, n * d.x_sf_row_floats);
    publish(d, epoch, seq, ReadyKind::kLayout);
    end_chunk(d, seq);
}

// Consume one invocation: every chunk of every source until each has sent its end of stream, copying
// rows to out_*[src][token_base + t] and adding the counts to out_counts[src]. Outputs hold
// `capacity` rows per source; a chunk that would not fit is read as empty and reported
// (protocol/validate.cuh), never written.
// Any grid: every block waits for every chunk and copies its contiguous share of the rows;
// the last block done with a chunk acknowledges it (arrivals [W * S], zeroed by the host before the
// launch; null for a one-block grid, which acknowledges directly). One block is the smallest consumer; a grid that fills its SMs is the persistent-consumer
// shape whose progress the SM partition protects.
extern "C" __global__ void ring_gather(const RingDesc* desc, unsigned char* out_x, float* out_x_sf, int* out_topk_idx,
                                       float* out_topk_weights, long long* out_counts, long long capacity,
                                       CHUNKRING_NULLABLE unsigned* arrivals) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 cap = static_cast<u64>(capacity);
    consume_invocation(d, current_epoch(d), arrivals, nullptr, [&](u64 src, u64 seq, u64 slot) {
        const u64* meta = peer_view(d, slot_meta(d, slot), src);
        const u64 base = meta[kMetaTokenBase];
        const u64 n = checked_chunk_rows(d, src, slot, base, meta[kMetaNumTokens], cap,
                                         threadIdx.x == 0 && blockIdx.x == 0);  // all check, one reports
        // This block's share: rows [lo, hi) of the chunk, copied in bulk.
        const u64 lo = n * blockIdx.x / gridDim.x, hi = n * (blockIdx.x + 1) / gridDim.x, rows = hi - lo;
        const u64 row = src * cap + (n ? base : 0) + lo, row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats, K = d.topk;
        const auto* x = static_cast<const unsigned char*>(peer_view(d, slot_x(d, slot), src));
        block_copy16(out_x + row * row_bytes, x + lo * row_bytes, rows * row_bytes);
        block_copy4(out_x_sf + row * sf_floats, peer_view(d, slot_x_sf(d, slot), src) + lo * sf_floats, rows * sf_floats);
        block_copy4(out_topk_idx + row * K, peer_view(d, slot_topk_idx(d, slot), src) + lo * K, rows * K);
        block_copy4(out_topk_weights + row * K, peer_view(d, slot_topk_weights(d, slot), src) + lo * K, rows * K);
        if (threadIdx.x == 0 && blockIdx.x == 0) out_counts[src] += static_cast<long long>(n);
        return true;
    });
}
