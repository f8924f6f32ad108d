// How a consumer reaches a peer's slot, and a consumer its source's combine rows: the one place that
// chooses, per peer, between loads/stores through nvshmem_ptr (DIRECT) and NVSHMEM gets/puts (RMA), as
// RingDesc.rma_peers says (the host decided it when the ring was built: runtime/chunkring/ring/transport.py).
// Ordering (docs/PROTOCOL.md, "Transports"): a fetch runs after wait_chunk's acquire and is complete -
// its bytes in local memory - before fetch_done returns, hence before the ack that frees the slot;
// a put of combine rows is complete (quiet) before the kernel that issued it ends, hence before the
// held ack the next kernel of the stream sends. One quiet per block completes them (quiet_block).
#pragma once

#include "chunkring/comm/rma.cuh"
#include "chunkring/layout/ring_desc.cuh"
#include "chunkring/protocol/rules.cuh"  // status.cuh needs its u64
#include "chunkring/protocol/status.cuh"
#include "chunkring/util/copy.cuh"

namespace chunkring::protocol {

using namespace chunkring::layout;

__device__ __forceinline__ bool peer_is_rma(const RingDesc& d, u64 pe) { return d.rma_peers >> pe & 1; }

// A pointer to `local`'s counterpart in `src`'s buffer for direct loads and stores (NVLink or the same
// GPU), or null when NVSHMEM maps none. DIRECT peers only: the host chose DIRECT because it was not null.
template <typename T>
__device__ __forceinline__ T* direct_view(const T* local, u64 src) {
    return static_cast<T*>(nvshmem_ptr(const_cast<T*>(local), static_cast<int>(src)));
}

// 16-byte copies need `bytes` and both addresses on 16-byte boundaries; anything else goes word by word.
__device__ __forceinline__ bool copy16_ok(const void* a, const void* b, u64 bytes) {
    return ((reinterpret_cast<u64>(a) | reinterpret_cast<u64>(b) | bytes) & 15) == 0;
}

struct ChunkMeta {
    u64 token_base, num_tokens, flags;
};

// Thread-level: source `src`'s meta words of `slot`. ok false: a DIRECT peer without a mapping.
__device__ __forceinline__ bool fetch_meta(const RingDesc& d, u64 src, u64 slot, ChunkMeta& out) {
    const u64* meta = slot_meta(d, slot);
    if (peer_is_rma(d, src)) {
        const int pe = static_cast<int>(src);
        out = {comm::get_u64(meta + kMetaTokenBase, pe), comm::get_u64(meta + kMetaNumTokens, pe),
               comm::get_u64(meta + kMetaFlags, pe)};
        return true;
    }
    const u64* view = direct_view(meta, src);
    if (view == nullptr) return false;
    out = {view[kMetaTokenBase], view[kMetaNumTokens], view[kMetaFlags]};
    return true;
}

// Block-level: every thread gets source `src`'s meta words of `slot` (thread 0 fetches them). false,
// uniformly across the block, after recording PEER_UNREACHABLE, for a DIRECT peer without a mapping.
__device__ __forceinline__ bool chunk_meta(const RingDesc& d, u64 src, u64 slot, ChunkMeta& out) {
    __shared__ ChunkMeta fetched;
    __shared__ bool ok;
    if (threadIdx.x == 0) {
        ok = fetch_meta(d, src, slot, fetched);
        if (!ok) record_error(d, ErrorCode::kPeerUnreachable, Site::kPayload, src, slot, 0, 0);
    }
    __syncthreads();
    out = fetched;
    const bool result = ok;
    __syncthreads();  // every thread has read them before a later call overwrites them
    return result;
}

// Block-level: `bytes` (a multiple of 4; copy16_ok for speed) of source `src`'s
// slot part `part` (this rank's address of it: symmetric) into local `dst`, there and visible to the block
// on return. RMA: a blocking block get, so `dst` must be NVSHMEM-registered for an off-node peer - except
// for zero bytes, which fetch nothing (a bf16 row's scales, a block's empty share: `dst` may be any memory).
__device__ __forceinline__ void fetch_block(const RingDesc& d, void* dst, const void* part, u64 bytes, u64 src) {
    if (bytes != 0) {  // block-uniform: every thread passes the same arguments
        if (peer_is_rma(d, src)) {
            comm::get_block(dst, part, bytes, static_cast<int>(src));
        } else {
            const void* view = direct_view(part, src);
            if (copy16_ok(dst, view, bytes)) util::block_copy16(dst, view, bytes);
            else util::block_copy4(dst, view, bytes / 4);
        }
    }
    __syncthreads();
}

// Warp-level: start fetching `bytes` (a multiple of 4) of `src`'s slot part into local `dst`. Complete
// only after fetch_done(d, src) by the whole block.
__device__ __forceinline__ void fetch_warp(const RingDesc& d, void* dst, const void* part, u64 bytes, u64 src,
                                           unsigned lane) {
    if (bytes == 0) return;  // a bf16 row's scales: no get, so `dst` (an empty stage) need not be registered
    if (peer_is_rma(d, src)) {
        comm::get_warp_nbi(dst, part, bytes, static_cast<int>(src));
        return;
    }
    const void* view = direct_view(part, src);
    if (copy16_ok(dst, view, bytes)) {
        util::warp_copy16(dst, view, bytes, lane);
    } else {
        auto* out = static_cast<unsigned*>(dst);
        const auto* in = static_cast<const unsigned*>(view);
        for (u64 i = lane; i < bytes / 4; i += 32) out[i] = in[i];
    }
}

// Block-level, every thread of the block (no divergence: it holds barriers): complete every get and put
// the block's threads issued. One thread quiets for the block. nvshmem_quiet completes the operations
// "issued by the calling PE" (OpenSHMEM; NVSHMEM 3.4.5 does exactly that: a proxy quiet reads the PE's one
// issue counter, which every issuing thread bumps, and waits until the proxy acknowledged that far; a
// P2P-only job gets a __threadfence_system) - not the calling thread's alone, but only what was issued
// before the call, and OpenSHMEM leaves ordering other threads' issues before it to the caller. Hence:
// a barrier, so every thread's gets and puts are issued (their issue-counter updates visible to the
// quieting thread); thread 0 quiets; a barrier, so no thread goes on before the completion. Every thread
// quieting instead costs a proxy round trip per thread off-node. (IBGDA, compiled out here, comm/nvshmem.cuh,
// quiets per queue pair; enabling it would need this rule reviewed.)
__device__ __forceinline__ void quiet_block() {
    __syncthreads();  // every thread's operations issued before thread 0's quiet
    if (threadIdx.x == 0) comm::quiet();
    __syncthreads();  // nobody proceeds before they are complete
}

// Block-level: every fetch_warp of this block from `src` is complete and visible to the whole block.
// RMA: quiet_block; DIRECT: the barrier orders the warps' stores for the block.
__device__ __forceinline__ void fetch_done(const RingDesc& d, u64 src) {
    if (peer_is_rma(d, src)) quiet_block();  // `src` and the descriptor are block-uniform
    else __syncthreads();
}

// Block-level, after the block wrote `bytes` of local `row`: start writing them to `dst` (this rank's
// address of the destination: symmetric) on `pe` - an RMA peer's combine rows. `row` must stay unchanged,
// and NVSHMEM-registered for an off-node peer, until put_done().
__device__ __forceinline__ void put_block(void* dst, const void* row, u64 bytes, u64 pe) {
    __syncthreads();  // every thread's stores to `row` before any thread's part of the put reads it
    comm::put_block_nbi(dst, row, bytes, static_cast<int>(pe));
}

// Block-level (every thread of the block), after the block's last put_block: every put the block issued
// is in its peer's memory when this returns (so before the kernel ends). quiet_block: one quiet per block.
__device__ __forceinline__ void put_done() { quiet_block(); }

}  // namespace chunkring::protocol
