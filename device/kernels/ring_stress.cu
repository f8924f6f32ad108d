// Protocol stress kernels: producers and consumers exchange self-describing chunks through the real
// protocol (protocol/ring.cuh), with random delays on both sides and memory-stress blocks beside them.
// Built with CHUNKRING_MUTANT=<n> they run a deliberately broken protocol, which the tests must catch.
//
// ring_stress grid: block 0 = this rank's producer, blocks [1, 1 + consumer_blocks) = its consumer (each
// block checks every chunk; with more than one, the last to finish a chunk acknowledges it), the rest =
// memory stress.
#include "chunkring/layout/ring_args.cuh"
#include "chunkring/protocol/ring.cuh"
#include "chunkring/util/kernel_params.cuh"

using namespace chunkring;
using namespace chunkring::protocol;
using chunkring::layout::arg;
using chunkring::layout::require_args;
using chunkring::layout::RingStressArgs;

namespace {

__device__ __forceinline__ u64 mix(u64 x) {  // splitmix64 finaliser
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Word w of token row t of chunk seq from source src in epoch: identity, order and tearing all show.
__device__ __forceinline__ u64 row_word(u64 src, u64 epoch, u64 seq, u64 t, u64 w) {
    return mix((src << 56) ^ (epoch << 44) ^ (seq << 20) ^ (t << 8) ^ w) | 1ull;
}
__device__ __forceinline__ int route_expert(const RingDesc& d, u64 src, u64 seq, u64 t, u64 k) {
    return (t + k) % 5 == 4 ? -1 : static_cast<int>(mix(src ^ (seq << 16) ^ (t << 4) ^ k) % d.num_experts);
}
__device__ __forceinline__ float route_weight(u64 seq, u64 t, u64 k) { return static_cast<float>((seq * 7 + t * 3 + k) % 1021) * 0.5f; }
__device__ __forceinline__ float layout_scale(u64 src, u64 seq, u64 t, u64 j) { return static_cast<float>((src * 131 + seq * 17 + t + j) % 4093); }

// Spin for a pseudo-random time in [0, max_ns), by the global timer.
__device__ __forceinline__ void random_delay(u64 seed, u64 a, u64 b, u32 max_ns) {
    if (max_ns == 0 || threadIdx.x != 0) return;
    const u64 until = ptx::globaltimer_ns() + mix(seed ^ (a << 32) ^ b) % max_ns;
    while (ptx::globaltimer_ns() < until) {}
}

// Memory stress: read-modify-write scattered lines of `stress[16..words)` so caches and the memory
// system stay busy beside the protocol, until `stop()` or 10 s. stress[0..16) is left to the caller.
template <typename Stop>
__device__ void memory_stress(u64* stress, u64 words, u64 seed, Stop stop) {
    u64 x = mix(seed ^ blockIdx.x ^ (static_cast<u64>(threadIdx.x) << 20));
    const u64 deadline = ptx::globaltimer_ns() + 10ull * 1000 * 1000 * 1000;
    while (!stop() && ptx::globaltimer_ns() < deadline) {
        for (int k = 0; k < 64; ++k) {
            x = mix(x);
            u64* p = stress + 16 + x % (words - 16);
            *p = *p + x;
        }
    }
}

// Returns false (uniformly across the block) once the protocol reported an error.
__device__ bool produce_invocation(const RingDesc& d, u64 epoch, u64 n_tokens, u64 seed, u32 max_delay_ns) {
    const u64 me = d.my_pe, T = d.tokens_per_slot;
    const u64 n_chunks = n_tokens == 0 ? 1 : (n_tokens + T - 1) / T;  // an empty rank still says "done"
    u64 seq = ptx::ld_relaxed_sys(control_word(d, kControlNextSeq));
    for (u64 c = 0; c < n_chunks; ++c, ++seq) {
        if (!begin_chunk(d, epoch, seq)) return false;
        random_delay(seed, me, seq, max_delay_ns);
        __syncthreads();
        const u64 slot = slot_of(seq, d.num_slots);
        const u64 base = c * T, count = n_tokens - base < T ? n_tokens - base : T;
        const bool route_first = mix(seed ^ seq ^ (me << 40)) & 1;
        for (int part = 0; part < 2; ++part) {
            if ((part == 0) == route_first) {
                int* idx = slot_topk_idx(d, slot);
                float* weight = slot_topk_weights(d, slot);
                for (u64 i = threadIdx.x; i < count * d.topk; i += blockDim.x) {
                    idx[i] = route_expert(d, me, seq, i / d.topk, i % d.topk);
                    weight[i] = route_weight(seq, i / d.topk, i % d.topk);
                }
                if (threadIdx.x == 0) {
                    u64* meta = slot_meta(d, slot);
                    meta[kMetaTokenBase] = base;
                    meta[kMetaNumTokens] = count;
                    meta[kMetaFlags] = c + 1 == n_chunks ? kMetaEndOfStream : 0;
                }
                publish(d, epoch, seq, ReadyKind::kRoute);
            } else {
                u64* x = reinterpret_cast<u64*>(slot_x(d, slot));
                const u64 row_words = d.x_row_bytes / 8;
                for (u64 i = threadIdx.x; i < count * row_words; i += blockDim.x)
                    x[i] = row_word(me, epoch, seq, i / row_words, i % row_words);
                float* sf = slot_x_sf(d, slot);
                for (u64 i = threadIdx.x; i < count * d.x_sf_row_floats; i += blockDim.x)
                    sf[i] = layout_scale(me, seq, i / d.x_sf_row_floats, i % d.x_sf_row_floats);
                publish(d, epoch, seq, ReadyKind::kLayout);
            }
        }
        end_chunk(d, seq);
    }
    return true;
}

// Check every word of chunk seq from src; returns false (after recording) on the first mismatch.
// Every return is uniform across the block: the verdict lives in shared memory.
__device__ bool check_chunk(const RingDesc& d, u64 epoch, u64 src, u64 seq, u64 expect_base, u64* out_count) {
    const u64 slot = slot_of(seq, d.num_slots);
    __shared__ u64 bad_expected, bad_observed;
    __shared__ int bad;
    const u64* meta = peer_view(d, slot_meta(d, slot), src);
    const u64* x = peer_view(d, reinterpret_cast<const u64*>(slot_x(d, slot)), src);
    const float* sf = peer_view(d, slot_x_sf(d, slot), src);
    const int* idx = peer_view(d, slot_topk_idx(d, slot), src);
    const float* weight = peer_view(d, slot_topk_weights(d, slot), src);
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    if (meta == nullptr || x == nullptr) {
        if (threadIdx.x == 0) record_error(d, ErrorCode::kPeerUnreachable, Site::kPayload, src, slot, 0, 0);
        return false;
    }
    const u64 count = meta[kMetaNumTokens], base = meta[kMetaTokenBase];
    const bool eos = meta[kMetaFlags] & kMetaEndOfStream;
    auto flag = [&](u64 expected, u64 observed) {
        if (atomicCAS(&bad, 0, 1) == 0) { bad_expected = expected; bad_observed = observed; }
    };
    if (threadIdx.x == 0 && (base != expect_base || count > d.tokens_per_slot || (count == 0 && !eos)))
        flag(expect_base, base);
    const u64 row_words = d.x_row_bytes / 8;
    for (u64 i = threadIdx.x; i < count * row_words && count <= d.tokens_per_slot; i += blockDim.x) {
        const u64 want = row_word(src, epoch, seq, i / row_words, i % row_words);
        if (x[i] != want) flag(want, x[i]);
    }
    for (u64 i = threadIdx.x; i < count * d.x_sf_row_floats && count <= d.tokens_per_slot; i += blockDim.x)
        if (sf[i] != layout_scale(src, seq, i / d.x_sf_row_floats, i % d.x_sf_row_floats)) flag(seq, __float_as_uint(sf[i]));
    for (u64 i = threadIdx.x; i < count * d.topk && count <= d.tokens_per_slot; i += blockDim.x) {
        if (idx[i] != route_expert(d, src, seq, i / d.topk, i % d.topk)) flag(seq, static_cast<u64>(idx[i]));
        if (weight[i] != route_weight(seq, i / d.topk, i % d.topk)) flag(seq, __float_as_uint(weight[i]));
    }
    __syncthreads();
    const bool failed = bad;
    __syncthreads();  // everyone has read `bad` before the next call may reset it
    if (failed) {
        if (threadIdx.x == 0) record_error(d, ErrorCode::kPayloadMismatch, Site::kPayload, src, slot, bad_expected, bad_observed);
        return false;
    }
    *out_count = count;
    return true;
}

// One invocation through the protocol's consumer loop, every chunk checked word by word by this block.
// `consumers`: the consumer blocks (null counts for a one-block consumer; finish_chunk); the first
// consumer block counts the tokens received.
__device__ bool consume_and_check(const RingDesc& d, u64 epoch, u64 seed, u32 max_delay_ns, ConsumerBlocks consumers,
                                  unsigned long long* received) {
    __shared__ u64 seen[kMaxWorldSize];  // tokens seen per source this invocation: the next token base
    for (u64 s = threadIdx.x; s < d.world_size; s += blockDim.x) seen[s] = 0;
    __syncthreads();
    return consume_invocation(d, epoch, consumers, nullptr, [&](u64 src, u64 seq, u64, const ChunkMeta&) {
        random_delay(seed ^ 0x55 ^ (static_cast<u64>(blockIdx.x) << 48), src, seq, max_delay_ns);
        __syncthreads();
        u64 n = 0;
        if (!check_chunk(d, epoch, src, seq, seen[src], &n)) return false;
        __syncthreads();  // every thread has read seen[src]
        if (threadIdx.x == 0) {
            seen[src] += n;
            if (blockIdx.x == 1) received[src] += n;
        }
        return true;
    });
}

}  // namespace

// plan[i * world_size + r]: tokens rank r produces in invocation i. received[r]: tokens this rank
// consumed from r (the host compares with the plan). stress: scratch words hammered by the stress blocks
// until every consumer block finished; stress[0] counts the finished consumer blocks.
// arrivals [world_size * num_slots] (zeroed; null when consumer_blocks is 1): the multi-block consumer's counts.
// A multi-block consumer runs one invocation per launch: each block reads the cursors when its invocation
// starts, which is safe only before any block can arrive and advance them (consume_invocation).
extern "C" __global__ void ring_stress(const __grid_constant__ RingStressArgs args) {
    require_args(args);
    const auto* desc = arg<const RingDesc*>(args.desc);
    const auto* plan = arg<const int*>(args.plan);
    const int invocations = arg<int>(args.invocations);
    const u64 seed = arg<u64>(args.seed);
    const unsigned max_delay_ns = arg<unsigned>(args.max_delay_ns);
    auto* received = arg<unsigned long long*>(args.received);
    auto* stress = arg<u64*>(args.stress);
    const u64 stress_words = arg<u64>(args.stress_words);
    auto* arrivals = arg<unsigned*>(args.arrivals);  // null for one consumer block
    const int consumer_blocks = arg<int>(args.consumer_blocks);
    const RingDesc& d = *desc;
    if (!check_descriptor(d)) return;
    const u64 epoch = current_epoch(d);
    const ConsumerBlocks consumers{arrivals, static_cast<unsigned>(consumer_blocks)};
    const unsigned consumers_end = 1 + consumers.blocks;
    if (blockIdx.x == 0) {
        for (int i = 0; i < invocations; ++i)
            if (!produce_invocation(d, epoch, static_cast<u64>(plan[i * d.world_size + d.my_pe]), seed + i, max_delay_ns)) break;
    } else if (blockIdx.x < consumers_end) {
        for (int i = 0; i < invocations; ++i)
            if (!consume_and_check(d, epoch, seed + i, max_delay_ns, consumers, received)) break;
        __syncthreads();
        // NOTES: relaxed - the count only stops the stress blocks, which poll it.
        if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(stress), 1ull);
    } else {
        memory_stress(stress, stress_words, seed,
                      [&] { return ptx::ld_relaxed_sys(stress) >= static_cast<u64>(consumer_blocks) || has_error(d); });
    }
}

// Message-passing litmus across PEs, with the protocol's own publish and wait fences (ring.cuh
// publish_release_fence, wait_acquire_fence: their mutants remove or weaken them here too). Two
// directions, each a kernel: litmus_mp (push) - the writer PE stores data then a flag into the reader
// PE's memory; litmus_mp_pull (the ring's direction) - the writer stores data into its own memory and
// SETs the flag in the reader's, and the reader loads the data through nvshmem_ptr. Either way the reader
// sees the flag, fences (acquire), and reads the data; flag i with data < i is a violation. The data
// accesses are plain (weak) loads and stores, as payload accesses are: L1 may serve a stale copy unless
// the acquire fence invalidates it. Blocks [0, mp_blocks) run one message-passing pair per thread, each
// on its own lines (data and flag 128 B apart); blocks >= mp_blocks stress memory until every pair
// block is done.
template <typename ReadData>
__device__ unsigned long long litmus_read(const u64* flag, int iters, ReadData read_data) {
    unsigned long long bad = 0;
    const u64 deadline = ptx::globaltimer_ns() + 10ull * 1000 * 1000 * 1000;
    for (u64 seen = 0; seen < static_cast<u64>(iters) && ptx::globaltimer_ns() < deadline;) {
        const u64 f = ptx::ld_relaxed_sys(flag);
        if (f == seen) continue;
        wait_acquire_fence();
        bad += read_data() < f;
        seen = f;
    }
    return bad;
}

__device__ void litmus_lane(u64* lines, int writer, int reader, int iters, unsigned long long* violations) {
    const int me = nvshmem_my_pe();
    const u64 lane = blockIdx.x * blockDim.x + threadIdx.x;
    u64* data = lines + lane * 32;  // data and flag 128 B apart: different lines
    u64* flag = data + 16;
    if (me == writer) {
        u64* remote_data = static_cast<u64*>(nvshmem_ptr(data, reader));
        u64* remote_flag = static_cast<u64*>(nvshmem_ptr(flag, reader));
        if (remote_data == nullptr) return;
        for (u64 i = 1; i <= static_cast<u64>(iters); ++i) {
            *remote_data = i;  // NOTES: weak data store, like a payload row
            publish_release_fence();
            ptx::st_relaxed_sys(remote_flag, i);
        }
    } else if (me == reader) {
        // NOTES: weak data load, like a payload read (may hit a stale L1 line)
        const unsigned long long bad = litmus_read(flag, iters, [&] { return *data; });
        if (bad) atomicAdd(violations, bad);
    }
}

// The ring's direction: the writer is a producer filling its own slot and publishing it (P3), the
// reader a consumer observing the ready word in its own memory (C1) and reading the slot through
// nvshmem_ptr (peer_view).
__device__ void litmus_pull_lane(u64* lines, int writer, int reader, int iters, unsigned long long* violations) {
    const int me = nvshmem_my_pe();
    const u64 lane = blockIdx.x * blockDim.x + threadIdx.x;
    u64* data = lines + lane * 32;
    u64* flag = data + 16;
    if (me == writer) {
        for (u64 i = 1; i <= static_cast<u64>(iters); ++i) {
            *data = i;  // NOTES: weak local store, like a producer's slot row
            publish_release_fence();
            comm::signal_set_relaxed(flag, i, reader);  // the ready SET, into the reader's memory
        }
    } else if (me == reader) {
        const u64* peer_data = static_cast<const u64*>(nvshmem_ptr(data, writer));
        if (peer_data == nullptr) return;
        // NOTES: weak load through the peer mapping, like a consumer's slot read (may hit a stale L1 line)
        const unsigned long long bad = litmus_read(flag, iters, [&] { return *peer_data; });
        if (bad) atomicAdd(violations, bad);
    }
}

template <typename Lane>
__device__ void litmus_grid(Lane lane, int mp_blocks, u64* stress, u64 stress_words, int iters) {
    if (blockIdx.x < static_cast<unsigned>(mp_blocks)) {
        lane();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(stress), 1ull);  // this pair block is done
    } else {
        // NOTES: relaxed - the done count only stops the stress early.
        memory_stress(stress, stress_words, iters, [&] { return ptx::ld_relaxed_sys(stress) >= static_cast<u64>(mp_blocks); });
    }
}

extern "C" __global__ void litmus_mp(u64* lines, int writer, int reader, int iters, unsigned long long* violations,
                                     int mp_blocks, u64* stress, u64 stress_words) {
    litmus_grid([&] { litmus_lane(lines, writer, reader, iters, violations); }, mp_blocks, stress, stress_words, iters);
}

extern "C" __global__ void litmus_mp_pull(u64* lines, int writer, int reader, int iters,
                                          unsigned long long* violations, int mp_blocks, u64* stress,
                                          u64 stress_words) {
    litmus_grid([&] { litmus_pull_lane(lines, writer, reader, iters, violations); }, mp_blocks, stress, stress_words,
                iters);
}
