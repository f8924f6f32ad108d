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

// Ack words: [tag:32 | mask:32]. The tag names the generation being acknowledged (16 low bits of
// the epoch, 16 low bits of the lap field): the owner arms the word with it before publishing, and a
// consumer sets its bit only if the tag matches (compare-and-swap), so no ack can be counted for
// another generation - not one from an aborted epoch, not one from another lap.
constexpr u32 kAckBitsPerWord = 32;
constexpr u32 kAckWordsPerSlot = 2;
constexpr u32 kMaxWorldSize = kAckBitsPerWord * kAckWordsPerSlot;  // == runtime/ring/spec.py MAX_WORLD_SIZE
__host__ __device__ constexpr u32 ack_tag(u64 gen, u32 epoch_bits) {
    return static_cast<u32>(((gen_epoch(gen, epoch_bits) & 0xffffu) << 16) | (gen_lap_field(gen, epoch_bits) & 0xffffu));
}
__host__ __device__ constexpr u64 ack_value(u32 tag, u32 mask) { return (static_cast<u64>(tag) << 32) | mask; }
__host__ __device__ constexpr u32 ack_value_tag(u64 value) { return static_cast<u32>(value >> 32); }
__host__ __device__ constexpr u32 ack_value_mask(u64 value) { return static_cast<u32>(value); }
__host__ __device__ constexpr u32 ack_word_of(u32 rank) { return rank / kAckBitsPerWord; }
__host__ __device__ constexpr u32 ack_bit_of(u32 rank) { return 1u << (rank % kAckBitsPerWord); }
__host__ __device__ constexpr u32 ack_words_used(u32 world_size) { return (world_size + kAckBitsPerWord - 1) / kAckBitsPerWord; }
// All destination ranks whose bits live in ack word `word` (every rank consumes every chunk).
__host__ __device__ constexpr u32 ack_full_mask(u32 word, u32 world_size) {
    const u32 first = word * kAckBitsPerWord;
    const u32 count = world_size <= first ? 0 : (world_size - first >= kAckBitsPerWord ? kAckBitsPerWord : world_size - first);
    return count == kAckBitsPerWord ? 0xffffffffu : ((1u << count) - 1u);
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
static_assert(ack_tag(make_gen(1, 0, 16), 16) == 0x00010001u && ack_tag(make_gen(1, 0x10000, 16), 16) == 0x00010001u);
static_assert(ack_full_mask(0, 1) == 1u && ack_full_mask(0, 32) == 0xffffffffu && ack_full_mask(1, 32) == 0u);
static_assert(ack_full_mask(1, 33) == 1u && ack_full_mask(1, 64) == 0xffffffffu && ack_words_used(33) == 2);
static_assert(ack_word_of(31) == 0 && ack_word_of(32) == 1 && ack_bit_of(33) == 2u);

}  // namespace chunkring::protocol
