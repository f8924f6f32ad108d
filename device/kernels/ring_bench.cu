// Protocol latency microbenchmarks (benchmarks/bench_ring_latency.py), through the real device API.
//
// ring_publish_pingpong: PE 0 and PE 1 take turns publishing a chunk of their own ring and waiting
//   for the other's; half the round trip is one publish -> observe. Needs num_slots >= iters, so no
//   slot is reused (no ack waits) inside the measurement.
// ring_slot_roundtrip: PE 0 produces into a one-slot ring; every PE consumes and acknowledges. Each
//   iteration is one full slot round trip: publish -> consume -> ack by every rank -> reusable.
// ring_ack_cost: the same round trip with each side's share timed: PE 0's wait in begin_chunk for every
//   destination's ack word, and each consumer's ack_chunk (one remote swap, a fetching atomic: a full
//   round trip to the owner) and wait for the chunk. elapsed_ns[4] per PE: [0] producer total, [1]
//   producer's ack waits (PE 0 only), [2] this consumer's acks, [3] this consumer's chunk waits.
#include "chunkring/protocol/ring.cuh"
#include "chunkring/util/kernel_params.cuh"

using namespace chunkring;
using namespace chunkring::protocol;

extern "C" __global__ void ring_publish_pingpong(const RingDesc* desc, int iters, unsigned long long* elapsed_ns) {
    const RingDesc& d = *desc;
    if (!check_descriptor(d) || d.my_pe > 1 || d.num_slots < static_cast<u64>(iters)) return;
    const u64 epoch = current_epoch(d), me = d.my_pe, other = 1 - me;
    const u64 start = ptx::globaltimer_ns();
    for (u64 seq = 0; seq < static_cast<u64>(iters); ++seq) {
        if (me == 1 && !wait_chunk(d, epoch, other, seq)) return;
        if (!begin_chunk(d, epoch, seq)) return;
        publish(d, epoch, seq, ReadyKind::kRoute);
        publish(d, epoch, seq, ReadyKind::kLayout);
        end_chunk(d, seq);
        if (me == 0 && !wait_chunk(d, epoch, other, seq)) return;
    }
    if (threadIdx.x == 0) *elapsed_ns = ptx::globaltimer_ns() - start;
}

namespace {

// PE 0 produces into a one-slot ring; every PE's second block consumes and acknowledges. kTimeShares: also
// time each side's share of it (globaltimer reads in the loop, so the plain round trip is measured without).
template <bool kTimeShares>
__device__ void slot_roundtrip(const RingDesc& d, u64 n, unsigned long long* elapsed_ns) {
    const u64 epoch = current_epoch(d);
    if (blockIdx.x == 0) {
        if (d.my_pe != 0) return;
        u64 ack_wait = 0;
        const u64 start = ptx::globaltimer_ns();
        for (u64 seq = 0; seq <= n; ++seq) {  // the last begin_chunk waits for the acks of chunk n - 1
            [[maybe_unused]] const u64 t0 = kTimeShares ? ptx::globaltimer_ns() : 0;
            if (!begin_chunk(d, epoch, seq)) return;
            if constexpr (kTimeShares) ack_wait += ptx::globaltimer_ns() - t0;
            if (seq == n) break;
            publish(d, epoch, seq, ReadyKind::kRoute);
            publish(d, epoch, seq, ReadyKind::kLayout);
            end_chunk(d, seq);
        }
        if (threadIdx.x == 0) {
            elapsed_ns[0] = ptx::globaltimer_ns() - start;
            if constexpr (kTimeShares) elapsed_ns[1] = ack_wait;
        }
    } else {
        u64 ack = 0, wait = 0;
        for (u64 seq = 0; seq < n; ++seq) {
            [[maybe_unused]] const u64 t0 = kTimeShares ? ptx::globaltimer_ns() : 0;
            if (!wait_chunk(d, epoch, 0, seq)) return;
            [[maybe_unused]] const u64 t1 = kTimeShares ? ptx::globaltimer_ns() : 0;
            if (!ack_chunk(d, epoch, 0, seq)) return;
            if constexpr (kTimeShares) {
                ack += ptx::globaltimer_ns() - t1;
                wait += t1 - t0;
            }
        }
        if (kTimeShares && threadIdx.x == 0) {
            elapsed_ns[2] = ack;
            elapsed_ns[3] = wait;
        }
    }
}

}  // namespace

extern "C" __global__ void ring_slot_roundtrip(const RingDesc* desc, int iters, unsigned long long* elapsed_ns) {
    if (check_descriptor(*desc)) slot_roundtrip<false>(*desc, static_cast<u64>(iters), elapsed_ns);
}

extern "C" __global__ void ring_ack_cost(const RingDesc* desc, int iters, unsigned long long* elapsed_ns) {
    if (check_descriptor(*desc)) slot_roundtrip<true>(*desc, static_cast<u64>(iters), elapsed_ns);
}
