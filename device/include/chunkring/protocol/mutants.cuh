// Deliberately broken protocol variants, for negative controls only. Each removes exactly one rule, and
// a GPU test must catch every one: 1-4 and 7 (ring.cuh, rules.cuh) tests/stress/test_mutants.py; 5 and 6 the
// tests of the kernels that rely on those rules (runtime/testing/stress.py names them).
// Values are append-only; production builds never define the macro.
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
    kNoDeferredAck = 6,   // consume: an ack the caller defers is sent at once, before what it was deferred for
    kAckAnyGeneration = 7,  // reuse: an ack word counts whatever generation it holds (rules.cuh classify_acked)
};

constexpr Mutant kMutant = static_cast<Mutant>(CHUNKRING_MUTANT);

}  // namespace chunkring::protocol
