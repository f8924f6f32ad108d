// Deliberately broken protocol variants, for the stress suite's negative controls only.
// Each removes exactly one rule from protocol/ring.cuh; the GPU stress tests must catch every one
// (tests/gpu/test_ring_mutants.py). Values are append-only; production builds never define the macro.
#pragma once

#ifndef CHUNKRING_MUTANT
#define CHUNKRING_MUTANT 0
#endif

namespace chunkring::protocol {

enum class Mutant : unsigned {
    kNone = 0,
    kNoReleaseFence = 1,  // publish: the signal is not preceded by a system-scope release fence
    kNoAcquireFence = 2,  // wait: payload reads are not ordered after the observed generation
    kNoAckWait = 3,       // reuse: the producer overwrites a slot without waiting for every ack
    kIgnoreEpoch = 4,     // wait: generations are compared without their epoch
    kNoInputChecks = 5,   // consume: slot values used as counts, indices and scales unchecked (validate.cuh)
    kNoHeldAck = 6,       // MoE layer: a source's last chunk is acknowledged at its pull, before the combine
};

constexpr Mutant kMutant = static_cast<Mutant>(CHUNKRING_MUTANT);

}  // namespace chunkring::protocol
