// The ring's rules, each in one constexpr function (docs/PROTOCOL.md names them). Kernels call these;
// nothing re-derives a slot, a lap, a generation or an ack word inline. The static_asserts pin the
// boundaries; every kernel build checks them (tests/compile/).
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/protocol/mutants.cuh"

namespace chunkring::protocol {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

// A source's chunks are numbered seq = 0, 1, 2, ... since the current epoch began (across
// invocations and graph replays). Chunk seq lives in slot seq % S during lap seq / S.
__host__ __device__ constexpr u64 slot_of(u64 seq, u64 num_slots) { return seq % num_slots; }
__host__ __device__ constexpr u64 lap_of(u64 seq, u64 num_slots) { return seq / num_slots; }

// Generation: epoch in the high `epoch_bits`, lap + 1 below (0 means "never published").
__host__ __device__ constexpr u64 seq_mask(u32 epoch_bits) { return ~0ull >> epoch_bits; }
__host__ __device__ constexpr u64 make_gen(u64 epoch, u64 lap, u32 epoch_bits) {
    return (epoch << (64 - epoch_bits)) | ((lap + 1) & seq_mask(epoch_bits));
}
__host__ __device__ constexpr u64 gen_epoch(u64 gen, u32 epoch_bits) { return gen >> (64 - epoch_bits); }
__host__ __device__ constexpr u64 gen_lap_field(u64 gen, u32 epoch_bits) { return gen & seq_mask(epoch_bits); }
// A lap whose generation would not fit must never be published (it would alias lap 0 - ABA).
__host__ __device__ constexpr bool lap_fits(u64 lap, u32 epoch_bits) { return lap < seq_mask(epoch_bits); }

// What a ready word holding `observed` means to a consumer expecting `expected`.
enum class GenState : u32 { kNotYet = 0, kReady = 1, kStaleEpoch = 2, kAhead = 3 };
__host__ __device__ constexpr GenState classify_gen(u64 observed, u64 expected, u32 epoch_bits) {
    if constexpr (kMutant == Mutant::kIgnoreEpoch) {
        observed &= seq_mask(epoch_bits);
        expected &= seq_mask(epoch_bits);
    }
    if (observed == expected) return GenState::kReady;
    if (observed == 0) return GenState::kNotYet;  // zeroed by the last reset, nothing published yet
    if (gen_epoch(observed, epoch_bits) != gen_epoch(expected, epoch_bits)) return GenState::kStaleEpoch;
    return gen_lap_field(observed, epoch_bits) < gen_lap_field(expected, epoch_bits) ? GenState::kNotYet
                                                                                    : GenState::kAhead;
}

// Ack words: one per (slot, destination) at the slot's owner, holding the full generation of the
// chunk that destination last acknowledged in that slot (0 after a reset). Destination d acknowledges
// chunk seq by one remote atomic swap writing gen(seq) into its own word, and checks the value it
// replaced: it must be the generation d acknowledged there one lap before (ack_prev_gen). The owner
// accepts chunk seq's slot back only when every destination's word holds exactly gen(seq) (compared
// with classify_gen, like a ready word), so no ack can be counted for another generation - not one from
// an aborted epoch, not one from another lap - and each ack costs one remote atomic at any world size.
constexpr u32 kMaxWorldSize = 64;  // == runtime/chunkring/ring/spec.py MAX_WORLD_SIZE (consume_invocation's u64 mask)
__host__ __device__ constexpr u64 ack_prev_gen(u64 epoch, u64 seq, u64 num_slots, u32 epoch_bits) {
    return seq < num_slots ? 0 : make_gen(epoch, lap_of(seq - num_slots, num_slots), epoch_bits);
}
// What the value an ack's swap replaced says about that ack of generation `gen`.
enum class AckState : u32 { kFirst = 0, kDouble = 1, kUnexpected = 2 };
__host__ __device__ constexpr AckState classify_ack(u64 replaced, u64 gen, u64 prev_gen) {
    if constexpr (kMutant == Mutant::kAckAnyGeneration) return AckState::kFirst;
    if (replaced == prev_gen) return AckState::kFirst;
    return replaced == gen ? AckState::kDouble : AckState::kUnexpected;
}
// The owner's test of one destination's ack word for chunk generation `gen` (P1).
__host__ __device__ constexpr GenState classify_acked(u64 observed, u64 gen, u32 epoch_bits) {
    if constexpr (kMutant == Mutant::kAckAnyGeneration) return observed != 0 ? GenState::kReady : GenState::kNotYet;
    return classify_gen(observed, gen, epoch_bits);
}

// ---- boundaries pinned: checked by every kernel build ----
static_assert(slot_of(5, 2) == 1 && lap_of(5, 2) == 2);
static_assert(make_gen(0, 0, 16) == 1 && make_gen(1, 0, 16) == ((1ull << 48) | 1));
static_assert(gen_epoch(make_gen(0xffff, 7, 16), 16) == 0xffff && gen_lap_field(make_gen(0xffff, 7, 16), 16) == 8);
static_assert(lap_fits(seq_mask(16) - 1, 16) && !lap_fits(seq_mask(16), 16));
static_assert(kMutant != Mutant::kNone || classify_gen(make_gen(3, 4, 16), make_gen(3, 4, 16), 16) == GenState::kReady);
static_assert(kMutant != Mutant::kNone || classify_gen(0, make_gen(3, 0, 16), 16) == GenState::kNotYet);
static_assert(kMutant != Mutant::kNone || classify_gen(make_gen(3, 3, 16), make_gen(3, 4, 16), 16) == GenState::kNotYet);
static_assert(kMutant != Mutant::kNone || classify_gen(make_gen(3, 5, 16), make_gen(3, 4, 16), 16) == GenState::kAhead);
static_assert(kMutant != Mutant::kNone || classify_gen(make_gen(2, 4, 16), make_gen(3, 4, 16), 16) == GenState::kStaleEpoch);
static_assert(kMutant != Mutant::kNone || classify_gen(make_gen(4, 0, 16), make_gen(3, 4, 16), 16) == GenState::kStaleEpoch);
static_assert(ack_prev_gen(3, 1, 2, 16) == 0 && ack_prev_gen(3, 2, 2, 16) == make_gen(3, 0, 16));
static_assert(ack_prev_gen(3, 5, 2, 16) == make_gen(3, 1, 16));
static_assert(kMutant != Mutant::kNone || classify_ack(0, make_gen(3, 0, 16), 0) == AckState::kFirst);
static_assert(kMutant != Mutant::kNone || classify_ack(make_gen(3, 1, 16), make_gen(3, 1, 16), make_gen(3, 0, 16)) == AckState::kDouble);
static_assert(kMutant != Mutant::kNone || classify_ack(make_gen(2, 0, 16), make_gen(3, 0, 16), 0) == AckState::kUnexpected);
static_assert(kMutant != Mutant::kNone || classify_acked(make_gen(3, 0, 16), make_gen(3, 1, 16), 16) == GenState::kNotYet);
static_assert(kMutant != Mutant::kNone || classify_acked(make_gen(2, 1, 16), make_gen(3, 1, 16), 16) == GenState::kStaleEpoch);
}  // namespace chunkring::protocol
