// Bring-up self-test: NVSHMEM device calls across ranks, with the data checked on the receiver.
//
// selftest_ring_pass: every PE puts a self-describing block into its right neighbour's `recv`,
// publishes it with a signal, and the neighbour checks every word; each PE then ORs its bit into PE 0's
// `mask[round]`. The host separates rounds with a barrier, so `recv` is never overwritten unread.
// selftest_pingpong: the raw signal round trip between two PEs, the floor our protocol is measured against.
#include "chunkring/comm/signal.cuh"
#include "chunkring/ptx/ordering.cuh"
#include "chunkring/util/kernel_params.cuh"

using chunkring::ptx::u32;
using chunkring::ptx::u64;

// Word i of the block that `src_pe` sends in `round`: source, round and index all recoverable.
__device__ __forceinline__ u64 selftest_word(int src_pe, u64 round, int i) {
    return (static_cast<u64>(src_pe) << 48) ^ (round << 24) ^ static_cast<u64>(i) ^ 0x5a5a000000000000ull;
}

extern "C" __global__ void selftest_ring_pass(u64* send, u64* recv, u64* signal, u64* mask, u32* errors,
                                              int n_words, u64 round) {
    const int me = nvshmem_my_pe(), n_pes = nvshmem_n_pes();
    const int right = (me + 1) % n_pes, left = (me + n_pes - 1) % n_pes;

    for (int i = threadIdx.x; i < n_words; i += blockDim.x) send[i] = selftest_word(me, round, i);
    __syncthreads();
    nvshmemx_uint64_put_block(recv, send, n_words, right);
    __syncthreads();
    if (threadIdx.x == 0) {
        // Release: the put above must be visible at `right` before the signal (signal SET does not fence).
        nvshmem_fence();
        chunkring::comm::signal_set_relaxed(signal, round, right);
        chunkring::comm::signal_wait_eq_relaxed(signal, round);
        // Acquire: signal_wait_until does not order the loads below after it (NVSHMEM 3.4.5).
        chunkring::ptx::fence_acq_rel_sys();
    }
    __syncthreads();
    u32 bad = 0;
    for (int i = threadIdx.x; i < n_words; i += blockDim.x) bad += recv[i] != selftest_word(left, round, i);
    if (bad) atomicAdd(errors, bad);
    __syncthreads();
    if (threadIdx.x == 0) {
        chunkring::ptx::fence_acq_rel_sys();  // our checks complete before PE 0 may count us as done
        chunkring::comm::atomic_or_relaxed(mask + round, 1ull << me, 0);
    }
}

extern "C" __global__ void selftest_pingpong(u64* signal, int peer, int iters, int initiator, u64* elapsed_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 start = chunkring::ptx::globaltimer_ns();
    for (int i = 1; i <= iters; ++i) {
        // Even values travel initiator -> peer, odd ones back, so each side waits for a value only the
        // other side can have written.
        const u64 ping = 2 * static_cast<u64>(i), pong = ping + 1;
        if (initiator) {
            chunkring::comm::signal_set_relaxed(signal, ping, peer);
            chunkring::comm::signal_wait_eq_relaxed(signal, pong);
        } else {
            chunkring::comm::signal_wait_eq_relaxed(signal, ping);
            chunkring::comm::signal_set_relaxed(signal, pong, peer);
        }
    }
    *elapsed_ns = chunkring::ptx::globaltimer_ns() - start;
}
