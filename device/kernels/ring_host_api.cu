// Kernels behind the host-side ring API (runtime/ring.py Ring.publish_chunk / Ring.gather):
// a torch producer fills tensors and publishes them as the next chunk, stream-ordered; a consumer
// gathers every chunk of one invocation from every source into dense per-source outputs.
// Both go through the device API of protocol/ring.cuh; neither takes a host-supplied generation.
#include "chunkring/protocol/ring.cuh"
#include "chunkring/util/copy.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
using chunkring::util::block_copy16;
using chunkring::util::block_copy4;

// Publish rows [0, n_tokens) of the given tensors as this rank's next chunk. One block.
// x: [n, hidden] payload bytes; x_sf: [n, hidden/128] fp32 (FP8 only); topk_idx/topk_weights: [n, topk].
extern "C" __global__ void ring_publish_tensors(const RingDesc* desc, const unsigned char* x, const float* x_sf,
                                                const int* topk_idx, const float* topk_weights, int n_tokens,
                                                long long token_base, int end_of_stream) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 epoch = current_epoch(d);
    // NOTES: relaxed - only this rank's producers write next_seq, and they are stream-ordered.
    const u64 seq = ptx::ld_relaxed_sys(control_word(d, kControlNextSeq));
    if (!begin_chunk(d, epoch, seq)) return;
    const u64 slot = slot_of(seq, d.num_slots), n = static_cast<u64>(n_tokens);
    block_copy4(slot_topk_idx(d, slot), topk_idx, n * d.topk);
    block_copy4(slot_topk_weights(d, slot), topk_weights, n * d.topk);
    if (threadIdx.x == 0) {
        u64* meta = slot_meta(d, slot);
        meta[kMetaTokenBase] = static_cast<u64>(token_base);
        meta[kMetaNumTokens] = n;
        meta[kMetaFlags] = end_of_stream ? kMetaEndOfStream : 0;
    }
    publish(d, epoch, seq, ReadyKind::kRoute);
    block_copy16(slot_x(d, slot), x, n * d.x_row_bytes);
    block_copy4(slot_x_sf(d, slot), x_sf, n * d.x_sf_row_floats);
    publish(d, epoch, seq, ReadyKind::kLayout);
    end_chunk(d, seq);
}

// Consume one invocation: every chunk of every source until each has sent its end of stream, copying
// rows to out_*[src][token_base + t] and adding the counts to out_counts[src]. Outputs hold
// `capacity` rows per source; a chunk that would not fit is reported (kBadMetadata), not written.
// One block; the slot is acknowledged as soon as its rows are copied.
extern "C" __global__ void ring_gather(const RingDesc* desc, unsigned char* out_x, float* out_x_sf, int* out_topk_idx,
                                       float* out_topk_weights, long long* out_counts, long long capacity) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 cap = static_cast<u64>(capacity);
    consume_invocation(d, current_epoch(d), [&](u64 src, u64 seq, u64 slot) {
        const u64* meta = peer_view(d, slot_meta(d, slot), src);
        const u64 base = meta[kMetaTokenBase], n = meta[kMetaNumTokens];
        if (n > d.tokens_per_slot || base > cap || n > cap - base) {  // never index with an unchecked count
            if (threadIdx.x == 0) record_error(d, ErrorCode::kBadMetadata, Site::kPayload, src, slot, cap, base + n);
            return false;
        }
        const u64 row = src * cap + base;
        block_copy16(out_x + row * d.x_row_bytes, peer_view(d, slot_x(d, slot), src), n * d.x_row_bytes);
        block_copy4(out_x_sf + row * d.x_sf_row_floats, peer_view(d, slot_x_sf(d, slot), src), n * d.x_sf_row_floats);
        block_copy4(out_topk_idx + row * d.topk, peer_view(d, slot_topk_idx(d, slot), src), n * d.topk);
        block_copy4(out_topk_weights + row * d.topk, peer_view(d, slot_topk_weights(d, slot), src), n * d.topk);
        if (threadIdx.x == 0) out_counts[src] += static_cast<long long>(n);
        return true;
    });
}
