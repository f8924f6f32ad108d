// Deliberately broken protocol variants, for negative controls only. Each removes exactly one rule, and
// a GPU test must catch every one: 1-4, 7 and 9-12 (ring.cuh, rules.cuh) tests/stress/test_mutants.py; 11
// and 14 in the fused producer tests/stress/test_fused_producer_mutants.py; 5, 6, 8, 13 and 15 the tests of the
// kernels that rely on those rules, 16 the fault matrix (runtime/chunkring/testing/stress.py names them). A fence mutant may
// escape where every rank shares one GPU; its test says so (docs/PROTOCOL.md, "Evidence").
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
    kNoPushRelease = 8,     // combine push: a block arrives on the push count without releasing its stores first
    kNoAckRelease = 9,      // ack: the consumer's reads of the slot are not ordered before its ack swap
    kNoAckAcquire = 10,     // reuse, drain: what the owner does next is not ordered after the acks it observed
    kNoArrivalFences = 11,  // last of a grid (ring.cuh last_block_to_arrive): no fence orders each block's work
                            // before the last block's ack (multi-block consume) or publish (fused producer)
    kGpuScopeFences = 12,   // publish, wait: the release and the acquire fence at GPU scope, not system scope
    kSealOnReserve = 13,    // incremental blocks: a full block is sealed when its last row is reserved, before
                            // its rows landed (moe/blocks.cuh; the model's bug_seal_on_reserve)
    kArriveBeforeRows = 14,  // fused producer: each block arrives before storing its rows, so the last arrival
                             // publishes while rows are still being written (moe_produce.cu)
    kReduceEveryChoice = 15,  // reduction: every choice's combine row is added, routed or not, so a masked
                              // choice adds whatever its row held, which no rank wrote (moe_combine_reduce)
    kReduceAfterError = 16,   // reduction: a call whose drain gave up still sums its combine rows, some of them
                              // another call's, instead of returning zeros (moe_combine_reduce)
};

constexpr Mutant kMutant = static_cast<Mutant>(CHUNKRING_MUTANT);

}  // namespace chunkring::protocol
