// The ring protocol's device API: what a producer calls to fill and publish a slot, and what a
// consumer calls to wait for it and give it back. Every ordering rule of the ring in docs/PROTOCOL.md is
// here and nowhere else (the MoE layer's own edges live beside their kernels, as PROTOCOL.md names them). All functions are block-level: every thread of the block calls them together.
//
// Ownership (who writes which word):
//   slot payload + meta of source r ........ r's producer (local stores), read by every consumer
//   route_ready[r][s], layout_ready[r][s] ... r's producer, by remote SET into each destination's
//                                            own buffer, so every consumer spins on local memory
//   ack[s][d] words of owner r .............. consumer d alone, by one remote swap writing the
//                                            generation it acknowledges; r's producer polls them
//   consumed[s], control[next_seq] .......... r's producer;  cursor[src] ... this rank's consumer
//   control[epoch] .......................... the host, in the collective reset, between kernels
//   status[abort] ........................... the first rank to fail, by remote CAS into every rank's word
//                                            (status.cuh raise_abort); every spin_until polls its own
#pragma once

#include "chunkring/comm/signal.cuh"
#include "chunkring/layout/ring_desc.cuh"
#include "chunkring/protocol/rules.cuh"
#include "chunkring/protocol/status.cuh"
#include "chunkring/protocol/transport.cuh"
#include "chunkring/ptx/ordering.cuh"

namespace chunkring::protocol {

using namespace chunkring::layout;

__device__ __forceinline__ u32 epoch_bits(const RingDesc& d) { return static_cast<u32>(d.epoch_bits); }

// NOTES: relaxed - the host writes the epoch in the reset, stream-ordered before this kernel began.
__device__ __forceinline__ u64 current_epoch(const RingDesc& d) { return ptx::ld_relaxed_sys(control_word(d, kControlEpoch)); }

__device__ __forceinline__ u64 gen_of(const RingDesc& d, u64 epoch, u64 seq) {
    return make_gen(epoch, lap_of(seq, d.num_slots), epoch_bits(d));
}

// Thread 0 decides, the whole block follows.
__device__ __forceinline__ bool block_agree(bool thread0_ok) {
    __shared__ bool ok;
    if (threadIdx.x == 0) ok = thread0_ok;
    __syncthreads();
    const bool result = ok;
    __syncthreads();
    return result;
}

// The fences of the publish/observe edge (P3 -> C1), each in one place: the protocol and the litmus
// kernels (ring_stress.cu) both call these, so a mutant of either fence breaks both. System scope: the
// thread on the other side of the edge runs on another GPU, and the PTX memory model pairs a release
// with an acquire across GPUs only when both are .sys.
// P3: run by each signalling thread before its relaxed SET - fence, then store: a release pattern.
__device__ __forceinline__ void publish_release_fence() {
    if constexpr (kMutant == Mutant::kNoReleaseFence) return;
    else if constexpr (kMutant == Mutant::kGpuScopeFences) ptx::fence_acq_rel_gpu();
    else ptx::fence_acq_rel_sys();
}
// C1: run after the relaxed loads that observed the ready words - load, then fence: an acquire pattern.
__device__ __forceinline__ void wait_acquire_fence() {
    if constexpr (kMutant == Mutant::kNoAcquireFence) return;
    else if constexpr (kMutant == Mutant::kGpuScopeFences) ptx::fence_acq_rel_gpu();
    else ptx::fence_acq_rel_sys();
}

// A spin_until poll's verdict on a word that should reach generation `want` (a ready word, or an ack word
// at its owner): 1 there, 0 not yet, -1 after recording why it never will (another epoch's value, or a
// later lap's: a slot overwritten unread). Thread 0 only.
__device__ __forceinline__ int poll_verdict(const RingDesc& d, GenState state, Site site, u64 peer, u64 slot, u64 want,
                                            u64 observed) {
    switch (state) {
        case GenState::kReady: return 1;
        case GenState::kNotYet: return 0;
        case GenState::kStaleEpoch: record_error(d, ErrorCode::kStaleEpoch, site, peer, slot, want, observed); return -1;
        default: record_error(d, ErrorCode::kGenerationAhead, site, peer, slot, want, observed); return -1;
    }
}

// ---------------------------------------------------------------- producer (owner of the slot)

// Thread 0 only: poll until every destination acknowledged chunk `seq` (each destination's ack word
// of its slot holds seq's generation). A word of another epoch, or of a later lap, is an error, never
// accepted. Relaxed loads only: the caller's acquire fence after its last poll orders what follows.
__device__ __forceinline__ bool poll_acked(const RingDesc& d, u64 epoch, u64 seq) {
    const u64 slot = slot_of(seq, d.num_slots), gen = gen_of(d, epoch, seq);
    const u32 bits = epoch_bits(d);
    // One timeout for the whole wait, however many words it polls.
    const u64 deadline = ptx::globaltimer_ns() + d.timeout_ns;
    for (u64 dest = 0; dest < d.world_size; ++dest) {
        const u64* word = ack_word(d, slot, dest);
        const bool ok = spin_until(d, Site::kWaitReusable, dest, slot, gen, [&](u64& observed) {
            observed = ptx::ld_relaxed_sys(word);
            return poll_verdict(d, classify_acked(observed, gen, bits), Site::kWaitReusable, dest, slot, gen, observed);
        }, deadline);
        if (!ok) return false;
    }
    return true;
}

// acquire: every consumer's reads of the chunks whose acks were polled (and what they wrote for us)
// before our next step. One fence serves any number of polls before it: each observed ack with this
// fence after it is an acquire pattern. System scope: the consumers ran on other GPUs and released
// with system-scope fences before their swaps.
__device__ __forceinline__ void acquire_acks() {
    if constexpr (kMutant != Mutant::kNoAckAcquire) ptx::fence_acq_rel_sys();
}

// Thread 0 only: wait until every destination acknowledged chunk `seq`, then acquire.
// Orders: every consumer's reads of chunk `seq` (their release fence + swap) happen-before our
// acquire fence, hence before whatever the caller does next with the slot.
__device__ __forceinline__ bool wait_acked(const RingDesc& d, u64 epoch, u64 seq) {
    if (!poll_acked(d, epoch, seq)) return false;
    acquire_acks();
    return true;
}

// Before writing chunk `seq` into its slot: wait until every destination acknowledged the chunk
// that last used the slot (seq - S). Nothing is armed: each destination's ack word already holds
// gen(seq - S), the value its ack of seq must replace.
__device__ __forceinline__ bool begin_chunk(const RingDesc& d, u64 epoch, u64 seq) {
    bool ok = true;
    if (threadIdx.x == 0) {
        const u64 slot = slot_of(seq, d.num_slots), lap = lap_of(seq, d.num_slots);
        const u32 bits = epoch_bits(d);
        if (!lap_fits(lap, bits)) {
            record_error(d, ErrorCode::kLapOverflow, Site::kPublish, d.my_pe, slot, seq_mask(bits) - 1, lap);
            ok = false;
        }
        if (ok && lap >= 1 && kMutant != Mutant::kNoAckWait) {
            ok = wait_acked(d, epoch, seq - d.num_slots);
            // NOTES: relaxed - diagnostic for the host, read after the kernel ends.
            if (ok) ptx::st_relaxed_sys(consumed_word(d, slot), gen_of(d, epoch, seq - d.num_slots));
        }
    }
    return block_agree(ok);
}

// Wait until every chunk this producer has published in the epoch is acknowledged by every
// destination: the last chunk of each slot (a slot's ack words only ever belong to its latest chunk).
// A producer that learns through acks that consumers are done with its chunks - and with whatever
// they wrote back before acknowledging - calls this at the end of an invocation.
__device__ __forceinline__ bool drain(const RingDesc& d, u64 epoch) {
    bool ok = true;
    if (threadIdx.x == 0) {
        // NOTES: relaxed - only this rank's producers write next_seq, stream-ordered before us.
        const u64 next = ptx::ld_relaxed_sys(control_word(d, kControlNextSeq));
        const u64 first = next > d.num_slots ? next - d.num_slots : 0;
        for (u64 seq = first; ok && seq < next; ++seq) ok = poll_acked(d, epoch, seq);
        if (ok) acquire_acks();  // once, after every slot's acks were observed
    }
    return block_agree(ok);
}

enum class ReadyKind : u32 { kRoute = 0, kLayout = 1 };

// Publish one part of chunk `seq` to every destination. Call after the block wrote that part:
// route = topk_idx, topk_weights and meta; layout = x and x_sf. The two are independent and may be
// published in either order; a consumer reads the slot only once both are ready.
// Orders: the block's payload stores -> __syncthreads -> per signalling thread a system-scope release
// fence -> the remote SET (a plain store in NVSHMEM 3.4.5, so the fence is what makes it a release).
__device__ __forceinline__ void publish(const RingDesc& d, u64 epoch, u64 seq, ReadyKind kind) {
    __syncthreads();
    const u64 slot = slot_of(seq, d.num_slots), gen = gen_of(d, epoch, seq);
    u64* word = kind == ReadyKind::kRoute ? route_ready_word(d, d.my_pe, slot) : layout_ready_word(d, d.my_pe, slot);
    for (u64 dest = threadIdx.x; dest < d.world_size; dest += blockDim.x) {
        publish_release_fence();
        comm::signal_set_relaxed(word, gen, static_cast<int>(dest));
    }
}

// After both parts of chunk `seq` are published: advance the producer's persistent cursor.
__device__ __forceinline__ void end_chunk(const RingDesc& d, u64 seq) {
    __syncthreads();
    // NOTES: relaxed - only this producer reads it, in a later kernel (stream-ordered).
    if (threadIdx.x == 0) ptx::st_relaxed_sys(control_word(d, kControlNextSeq), seq + 1);
}

// ---------------------------------------------------------------- consumer (any rank)

// Wait until source `src` published both parts of chunk `seq`.
// Orders: the observed generations -> system-scope acquire fence -> __syncthreads -> the block's
// reads of the slot. A value of another epoch, or of a later lap, is an error, never accepted.
__device__ __forceinline__ bool wait_chunk(const RingDesc& d, u64 epoch, u64 src, u64 seq) {
    bool ok = true;
    if (threadIdx.x == 0) {
        const u64 slot = slot_of(seq, d.num_slots), want = gen_of(d, epoch, seq);
        const u32 bits = epoch_bits(d);
        for (u32 k = 0; ok && k < 2; ++k) {
            const bool route = k == 0;
            const u64* word = route ? route_ready_word(d, src, slot) : layout_ready_word(d, src, slot);
            const Site site = route ? Site::kWaitRoute : Site::kWaitLayout;
            // NOTES: relaxed polling; the acquire fence below orders the payload reads.
            ok = spin_until(d, site, src, slot, want, [&](u64& observed) {
                observed = ptx::ld_relaxed_sys(word);
                return poll_verdict(d, classify_gen(observed, want, bits), site, src, slot, want, observed);
            });
        }
        if (ok) wait_acquire_fence();
    }
    return block_agree(ok);
}

// A pointer to `local`'s counterpart in `src`'s buffer for direct loads (NVLink or same GPU), or
// null when the peer is only reachable through a network transport. Kernels that may run with RMA
// peers (RingDesc.rma_peers) read slots through protocol/transport.cuh's fetch_* instead.
template <typename T>
__device__ __forceinline__ const T* peer_view(const RingDesc& d, const T* local, u64 src) {
    return static_cast<const T*>(nvshmem_ptr(local, static_cast<int>(src)));
}

// Give chunk `seq` of source `src` back: after every thread finished reading it, write its generation
// into our ack word of the slot at the owner - one remote atomic swap, whatever the world size - and
// check what it replaced: our ack of the slot's previous lap (0 on lap 0). Our own generation there is
// a double ack; anything else (another epoch's value, a missing ack) an ack of the wrong generation.
// Both are reported; neither can make the owner count an ack it did not get, since the owner accepts
// only gen(seq) itself in every destination's word.
// Orders: the block's reads -> __syncthreads -> system-scope release fence -> remote swap.
__device__ __forceinline__ bool ack_chunk(const RingDesc& d, u64 epoch, u64 src, u64 seq) {
    __syncthreads();
    bool ok = true;
    if (threadIdx.x == 0) {
        const u64 slot = slot_of(seq, d.num_slots), gen = gen_of(d, epoch, seq);
        const u64 prev = ack_prev_gen(epoch, seq, d.num_slots, epoch_bits(d));
        // release: our reads of the slot before the owner may reuse it. System scope: the owner, whose
        // acquire this pairs with, runs on another GPU.
        if constexpr (kMutant != Mutant::kNoAckRelease) ptx::fence_acq_rel_sys();
        const u64 replaced = comm::atomic_swap_relaxed(ack_word(d, slot, d.my_pe), gen, static_cast<int>(src));
        switch (classify_ack(replaced, gen, prev)) {
            case AckState::kFirst: break;
            case AckState::kDouble: record_error(d, ErrorCode::kDoubleAck, Site::kAck, src, slot, prev, replaced); ok = false; break;
            default: record_error(d, ErrorCode::kAckTagMismatch, Site::kAck, src, slot, prev, replaced); ok = false; break;
        }
        // NOTES: relaxed - only this consumer reads its cursor, in later chunk steps or kernels.
        if (ok) ptx::st_relaxed_sys(cursor_word(d, src), seq + 1);
    }
    return block_agree(ok);
}

// ---------------------------------------------------------------- one invocation, consumer side

// The blocks that consume every chunk together: `counts` [world_size * num_slots] counts the finished
// blocks per (source, slot); it is zero between chunks (the last block zeroes it), and zeroed by the host
// before a kernel that may follow a failed one. `blocks` is how many arrive per chunk: the whole grid for
// a consumer kernel, fewer where other blocks of the grid do other work. Null `counts`: one block
// consumes alone and acknowledges directly.
struct ConsumerBlocks {
    unsigned* counts;
    unsigned blocks;
};

// Every block of the grid consumes: a consumer kernel's usual shape.
__device__ __forceinline__ ConsumerBlocks whole_grid(unsigned* counts) { return {counts, gridDim.x}; }

// Block-level: true, in every thread, in the last of `blocks` blocks to arrive on `count` (zero before the
// first arrival; the last leaves it zero). The one "last of a grid" rule, used by the multi-block consumer
// (C3', finish_chunk) and the fused producer's publish (moe_produce.cu).
// Orders: each block's memory operations -> __syncthreads -> GPU-scope release fence -> relaxed arrival; the
// last arrival -> GPU-scope acquire fence (the RMW chain on `count` makes every earlier arrival's release
// visible), so what the last block does next - an ack, a publish, whose system-scope release fence is then
// cumulative over it - is ordered after every block's work. GPU scope: the blocks share one GPU.
__device__ __forceinline__ bool last_block_to_arrive(unsigned* count, unsigned blocks) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        if constexpr (kMutant != Mutant::kNoArrivalFences) ptx::fence_acq_rel_gpu();  // release
        last = atomicAdd(count, 1u) == blocks - 1;
        if (last) {
            if constexpr (kMutant != Mutant::kNoArrivalFences) ptx::fence_acq_rel_gpu();  // acquire
            *count = 0;  // nobody arrives again before the last block's next step lets them
        }
    }
    __syncthreads();
    return last;
}

// Every consumer block consuming a chunk together: the last block to finish it acknowledges it.
__device__ __forceinline__ bool finish_chunk(const RingDesc& d, u64 epoch, u64 src, u64 seq, ConsumerBlocks consumers) {
    if (consumers.counts == nullptr) return ack_chunk(d, epoch, src, seq);
    unsigned* count = consumers.counts + src * d.num_slots + slot_of(seq, d.num_slots);
    return last_block_to_arrive(count, consumers.blocks) ? ack_chunk(d, epoch, src, seq) : true;
}

// Consume one invocation: chunk steps over the sources still active (rank order within a step), each
// chunk waited for, handed to `visit(src, seq, slot, meta)` (block-level; `meta`: the chunk's meta words,
// fetched once per block after the acquire, the same in every thread; returns false after recording an
// error), then acknowledged; a source drops out after its end-of-stream chunk. No global token count is
// needed, and an empty source (one empty end-of-stream chunk) stalls nobody.
// With `consumers.counts` (see finish_chunk), every consumer block runs this and visits every chunk, each
// doing its share of the work; with null, one block consumes alone. Each block starts from the
// consumer's cursors, read before its first arrival - hence before any block of this kernel can ack and
// advance them.
// With `deferred` [world_size] (nullable; a whole-grid consumer only), the acknowledgement of each
// source's end-of-stream chunk is deferred: the chunk is visited, its sequence number goes to
// deferred[src] (written by block 0), and the caller
// acknowledges it later with ack_chunk. Deferring an ack is always safe (C3 asks only that the reads
// come before it), and it lets the ack carry more: a consumer that writes results back to a source
// acknowledges that source's last chunk after the writes, so the source's drain() also tells it that
// every result has landed. Every other chunk is acknowledged as soon as it was read.
// `acked(src, seq)` (block-level) runs after each acknowledgement this kernel sends.
// Returns false, uniformly across the block, once any step failed.
struct NoHook {
    __device__ void operator()(u64, u64) const {}
};

template <typename Visit, typename Acked = NoHook>
__device__ bool consume_invocation(const RingDesc& d, u64 epoch, ConsumerBlocks consumers, u64* deferred, Visit visit,
                                   Acked acked = {}) {
    __shared__ u64 active, next_seq[kMaxWorldSize];
    __shared__ bool step_ok;
    __shared__ ChunkMeta step_meta;
    // NOTES: relaxed - only this consumer writes its cursors (ack_chunk), in earlier kernels or, within
    // this kernel, only after every block arrived at a chunk, i.e. after every block read them here.
    for (u64 src = threadIdx.x; src < d.world_size; src += blockDim.x)
        next_seq[src] = ptx::ld_relaxed_sys(cursor_word(d, src));
    if (threadIdx.x == 0) active = d.world_size == 64 ? ~0ull : (1ull << d.world_size) - 1;
    __syncthreads();
    while (active) {
        for (u64 src = 0; src < d.world_size; ++src) {
            if (!(active >> src & 1)) continue;
            const u64 seq = next_seq[src], slot = slot_of(seq, d.num_slots);
            if (!wait_chunk(d, epoch, src, seq)) return false;
            if (threadIdx.x == 0) {  // after wait_chunk's acquire: loads or gets, per src's transport
                step_ok = fetch_meta(d, src, slot, step_meta);
                if (!step_ok) record_error(d, ErrorCode::kPeerUnreachable, Site::kPayload, src, slot, 0, 0);
            }
            __syncthreads();
            if (!step_ok) return false;
            const bool step_eos = (step_meta.flags & kMetaEndOfStream) != 0;
            if (!visit(src, seq, slot, step_meta)) return false;
            if (deferred != nullptr && step_eos) {
                if (threadIdx.x == 0 && blockIdx.x == 0) deferred[src] = seq;
            } else {
                if (!finish_chunk(d, epoch, src, seq, consumers)) return false;
                acked(src, seq);
            }
            if (threadIdx.x == 0) {
                next_seq[src] = seq + 1;
                if (step_eos) active &= ~(1ull << src);
            }
            __syncthreads();
        }
    }
    return true;
}

}  // namespace chunkring::protocol
