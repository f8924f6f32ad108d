// Kernels behind the host-side ring API (runtime/chunkring/ring/io.py publish_chunk / gather):
// a torch producer fills tensors and publishes them as the next chunk, stream-ordered; a consumer
// gathers every chunk of one invocation from every source into dense per-source outputs.
// Both go through the device API of protocol/ring.cuh; neither takes a host-supplied generation.
#include "chunkring/layout/ring_args.cuh"
#include "chunkring/protocol/publish.cuh"
#include "chunkring/protocol/ring.cuh"
#include "chunkring/protocol/validate.cuh"
#include "chunkring/util/copy.cuh"
#include "chunkring/util/kernel_params.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::layout::RingPublishArgs;
using chunkring::util::block_copy16;
using chunkring::util::block_copy4;

// Publish rows [0, n_tokens) of the given tensors as this rank's next chunk, rows
// [token_base, token_base + n_tokens) of its batch.
// x: [n, hidden] payload bytes; x_sf: [n, hidden/128] fp32 (FP8 only); topk_idx/topk_weights: [n, topk]
// (ring_publish_tensors and ring_publish_copy take them, with the extent, as a RingPublishArgs: layout/ring_args.cuh).
//
// valid_tokens (nullable) and batch_rows: a device token count that may cut the chunk short (chunk_extent,
// protocol/publish.cuh).
//
// Two forms, the same protocol steps (protocol/ring.cuh: begin_chunk, the slot's stores, publish,
// end_chunk): ring_publish_tensors does all of them in one block; a chunk too large for one block to
// copy quickly is published by three kernels in the producer's stream - ring_publish_open (one block:
// begin_chunk), ring_publish_copy (a grid, each block a share of the rows) and ring_publish_close (one
// block: metadata, publish, end_chunk). Stream order is what orders them: the copy starts after the
// open's acquire of the slot's acks, and the close's system-scope release covers the copy kernel's
// stores (docs/PROTOCOL.md, "Ordering, edge by edge", the split publish). The copy and the close do
// nothing once this rank has recorded an error, so a failed open never lets a slot be overwritten.

namespace {

// This block's share of the chunk's rows [lo, hi) (of `parts` equal shares), copied into `slot`.
__device__ void copy_rows(const RingDesc& d, u64 slot, const RingPublishArgs& args, u64 n, u64 part, u64 parts) {
    const auto* x = arg<const unsigned char*>(args.x);
    const auto* x_sf = arg<const float*>(args.x_sf);
    const auto* topk_idx = arg<const int*>(args.topk_idx);
    const auto* topk_weights = arg<const float*>(args.topk_weights);
    const u64 lo = n * part / parts, hi = n * (part + 1) / parts, rows = hi - lo, K = d.topk;
    block_copy16(slot_x(d, slot) + lo * d.x_row_bytes, x + lo * d.x_row_bytes, rows * d.x_row_bytes);
    block_copy4(slot_x_sf(d, slot) + lo * d.x_sf_row_floats, x_sf + lo * d.x_sf_row_floats, rows * d.x_sf_row_floats);
    block_copy4(slot_topk_idx(d, slot) + lo * K, topk_idx + lo * K, rows * K);
    block_copy4(slot_topk_weights(d, slot) + lo * K, topk_weights + lo * K, rows * K);
}

// The publish's extent (chunk_extent, protocol/publish.cuh); `report`: this block reports a clamped count.
__device__ ChunkExtent extent_of(const RingDesc& d, const RingPublishArgs& args, bool report) {
    return chunk_extent(d, arg<int>(args.n_tokens), arg<long long>(args.token_base), arg<int>(args.end_of_stream),
                        arg<const int*>(args.valid_tokens), arg<long long>(args.batch_rows), report);
}

}  // namespace

// The whole publish in one block.
extern "C" __global__ void ring_publish_tensors(const __grid_constant__ RingPublishArgs args) {
    require_args(args);
    const RingDesc& d = *arg<const RingDesc*>(args.desc);
    if (!check_descriptor(d)) return;
    const ChunkExtent e = extent_of(d, args, true);
    if (!e.publish) return;  // block-uniform
    const u64 epoch = current_epoch(d), seq = next_seq(d);
    if (!begin_chunk(d, epoch, seq)) return;
    copy_rows(d, slot_of(seq, d.num_slots), args, e.n, 0, 1);
    close_chunk(d, epoch, seq, e, arg<long long>(args.token_base));
}

// A publish in three kernels, 1/3: wait until the slot is free (every destination acked its previous lap; one block).
extern "C" __global__ void ring_publish_open(const RingDesc* desc, int n_tokens, long long token_base,
                                             int end_of_stream, CHUNKRING_NULLABLE const int* valid_tokens,
                                             long long batch_rows) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    if (!chunk_extent(d, n_tokens, token_base, end_of_stream, valid_tokens, batch_rows, true).publish) return;
    begin_chunk(d, current_epoch(d), next_seq(d));  // a failure is recorded: the next two see it
}

// 2/3: every block copies its share of the rows into the slot.
extern "C" __global__ void ring_publish_copy(const __grid_constant__ RingPublishArgs args) {
    require_args(args);
    const RingDesc& d = *arg<const RingDesc*>(args.desc);
    if (!check_descriptor(d) || has_error(d)) return;
    const ChunkExtent e = extent_of(d, args, false);
    if (!e.publish) return;
    copy_rows(d, slot_of(next_seq(d), d.num_slots), args, e.n, blockIdx.x, gridDim.x);
}

// 3/3: metadata, publish, cursor (one block).
extern "C" __global__ void ring_publish_close(const RingDesc* desc, int n_tokens, long long token_base,
                                              int end_of_stream, CHUNKRING_NULLABLE const int* valid_tokens,
                                              long long batch_rows) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d) || has_error(d)) return;
    const ChunkExtent e = chunk_extent(d, n_tokens, token_base, end_of_stream, valid_tokens, batch_rows, false);
    if (!e.publish) return;
    close_chunk(d, current_epoch(d), next_seq(d), e, token_base);
}

// Consume one invocation: every chunk of every source until each has sent its end of stream, copying
// rows to out_*[src][token_base + t] and adding the counts to out_counts[src]. Outputs hold
// `capacity` rows per source; a chunk that would not fit is read as empty and reported
// (protocol/validate.cuh), never written.
// Any grid: every block waits for every chunk and copies its contiguous share of the rows;
// the last block done with a chunk acknowledges it (arrivals [W * S], zeroed by the host before the
// launch; null for a one-block grid, which acknowledges directly). One block is the smallest consumer; a grid that fills its SMs is the persistent-consumer
// shape whose progress the SM partition protects.
// The rows out_x, out_x_sf, out_topk_idx and out_topk_weights are where an RMA source's gets land, so they
// must be NVSHMEM-registered for an off-node source: GatherOutputs (io.py) takes them from the symmetric heap
// wherever any rank reads a peer by RMA. out_counts and arrivals are written by this kernel's own stores.
extern "C" __global__ void ring_gather(const RingDesc* desc, unsigned char* out_x, float* out_x_sf, int* out_topk_idx,
                                       float* out_topk_weights, long long* out_counts, long long capacity,
                                       CHUNKRING_NULLABLE unsigned* arrivals) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 cap = static_cast<u64>(capacity);
    consume_invocation(d, current_epoch(d), whole_grid(arrivals), nullptr,
                       [&](u64 src, u64, u64 slot, const ChunkMeta& meta) {
        // Every read of the slot is a fetch: loads or gets, per src's transport.
        const u64 base = meta.token_base;
        const u64 n = checked_chunk_rows(d, src, slot, base, meta.num_tokens, cap,
                                         threadIdx.x == 0 && blockIdx.x == 0);  // all check, one reports
        // This block's share: rows [lo, hi) of the chunk, copied in bulk.
        const u64 lo = n * blockIdx.x / gridDim.x, hi = n * (blockIdx.x + 1) / gridDim.x, rows = hi - lo;
        const u64 row = src * cap + (n ? base : 0) + lo, row_bytes = d.x_row_bytes, sf_floats = d.x_sf_row_floats, K = d.topk;
        fetch_block(d, out_x + row * row_bytes, slot_x(d, slot) + lo * row_bytes, rows * row_bytes, src);
        fetch_block(d, out_x_sf + row * sf_floats, slot_x_sf(d, slot) + lo * sf_floats, rows * sf_floats * sizeof(float), src);
        fetch_block(d, out_topk_idx + row * K, slot_topk_idx(d, slot) + lo * K, rows * K * sizeof(int), src);
        fetch_block(d, out_topk_weights + row * K, slot_topk_weights(d, slot) + lo * K, rows * K * sizeof(float), src);
        if (threadIdx.x == 0 && blockIdx.x == 0) out_counts[src] += static_cast<long long>(n);
        return true;
    });
}

// Record `code` as this rank's error and abort the ring (record_error, protocol/status.cuh): the host's way to
// stop the peers that wait in a collective call this rank will not make - one whose argument checks failed
// here (runtime/chunkring/ring/io.py raise_abort). Its record names no peer, slot or value. Thread 0 of one block.
extern "C" __global__ void ring_raise_abort(const RingDesc* desc, unsigned long long code) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    if (threadIdx.x == 0) record_error(d, static_cast<ErrorCode>(code), Site::kHostCheck, 0, 0, 0, 0);
}
