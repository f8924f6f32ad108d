// Error reporting for protocol kernels: the first error a rank's kernels see is recorded in its
// status region (code, PE, peer, slot, expected and observed values, site) and printed once; the
// kernel then returns instead of trapping, so the host can read the record and raise
// (runtime/chunkring/ring/status.py) and the CUDA context stays usable. Every spin-wait also stops once its rank
// has an error, so one failure ends the whole kernel quickly - and, through the abort word every rank
// of the ring holds, every peer's kernels too (raise_abort, spin_until). The error is also copied into a
// pinned host word (RingDesc::failure_word), which the host reads at each call's entry without
// synchronising (runtime/chunkring/ring/failure.py), so a later call raises instead of returning zeros.
#pragma once

#include "chunkring/comm/rma.cuh"
#include "chunkring/comm/signal.cuh"
#include "chunkring/layout/ring_desc.cuh"
#include "chunkring/ptx/ordering.cuh"

namespace chunkring::protocol {

using layout::RingDesc;

// Append-only; mirrored by runtime/chunkring/ring/status.py ErrorCode.
enum class ErrorCode : unsigned long long {
    kNone = 0,
    kTimeout = 1,          // a wait outlasted desc.timeout_ns
    kStaleEpoch = 2,       // a ready word carried another epoch's generation
    kGenerationAhead = 3,  // a ready word carried a later lap than expected: a slot was overwritten unread
    kAckTagMismatch = 4,   // an ack's swap replaced another generation than its previous-lap ack (name kept)
    kBadDescriptor = 5,    // layout version or descriptor size differ between host and device
    kLapOverflow = 6,      // the lap field is exhausted: reset the epoch
    kPayloadMismatch = 7,  // (test kernels) a row did not hold what its producer wrote
    kPeerUnreachable = 8,  // a peer's slot is not load/store reachable from here
    kDoubleAck = 9,        // an ack word already held this generation
    kBadMetadata = 10,     // retired: malformed slot metadata is now masked and reported (validate.cuh)
    kPeerAborted = 11,     // a wait stopped because a rank of the ring recorded an error (the abort word names it)
    kInternal = 12,        // an invariant of this rank's own kernels failed (moe/blocks.cuh, moe/descriptors.cuh)
    kHostUsage = 13,       // this rank refused a collective call at its entry (ring_raise_abort from the host)
};

// Where a wait or check happened; append-only, mirrored by runtime/chunkring/ring/status.py Site.
enum class Site : unsigned long long {
    kNone = 0, kWaitRoute = 1, kWaitLayout = 2, kWaitReusable = 3, kAck = 4, kPayload = 5, kDescriptor = 6, kPublish = 7,
    kWaitPushed = 8,  // moe_ack_held waiting for every combine-push block's arrival (values: block counts)
    kWaitBlocks = 9,      // a wave's claim waiting for sealed expert blocks (values: sealed block counts)
    kWaitAllocation = 10, // a pull lane waiting for another lane's allocation of its expert block (slot: expert)
    kBlocks = 11,         // an incremental-block invariant checked (slot: pool block; values: row counts)
    kHostCheck = 12,      // the host's argument checks of a collective call (no peer, slot or values)
};

// The abort word (status word kStatusAbort): [63:16] the epoch, [15:8] the rank that failed, [7:0] its
// error code - never 0 once raised, since a recorded code is never kNone. Mirrored by
// runtime/chunkring/ring/status.py AbortRecord. Wide enough: epochs have at most 32 bits (RingSpec.epoch_bits),
// ranks are < 64 and codes append-only below 256.
constexpr u64 kAbortCodeBits = 8, kAbortOriginBits = 8;
constexpr __host__ __device__ u64 make_abort(u64 epoch, u64 origin, ErrorCode code) {
    return epoch << (kAbortCodeBits + kAbortOriginBits) | origin << kAbortCodeBits | static_cast<u64>(code);
}
constexpr __host__ __device__ u64 abort_origin(u64 word) { return word >> kAbortCodeBits & ((1ull << kAbortOriginBits) - 1); }
constexpr __host__ __device__ u64 abort_code(u64 word) { return word & ((1ull << kAbortCodeBits) - 1); }
constexpr __host__ __device__ u64 abort_epoch(u64 word) { return word >> (kAbortCodeBits + kAbortOriginBits); }
static_assert(abort_origin(make_abort(0xffffffffull, 63, ErrorCode::kTimeout)) == 63, "origin field holds every rank");
static_assert(abort_epoch(make_abort(0xffffffffull, 63, ErrorCode::kTimeout)) == 0xffffffffull, "epoch field holds 32 bits");
static_assert(abort_code(make_abort(1, 0, ErrorCode::kPeerAborted)) == 11, "code field holds every code");
static_assert(make_abort(0, 0, ErrorCode::kTimeout) != 0, "a raised abort is never 0");

__device__ __forceinline__ bool has_error(const RingDesc& d) {
    // NOTES: relaxed is enough - this only makes a spin stop early; the record itself is read by the
    // host after the kernel ends.
    return ptx::ld_relaxed_sys(layout::status_word(d, layout::kStatusCode)) != 0;
}

// One more record of a kind (the status words `count` and `code_word` name it): counted always, and
// claimed by the first caller only - the one that then fills the record's other words (the host reads
// them after the kernel ends). Shared by the error record here and validate.cuh's input record.
__device__ __forceinline__ bool claim_first_record(const RingDesc& d, layout::StatusWord count,
                                                   layout::StatusWord code_word, u64 code) {
    atomicAdd(reinterpret_cast<unsigned long long*>(layout::status_word(d, count)), 1ull);
    return atomicCAS(reinterpret_cast<unsigned long long*>(layout::status_word(d, code_word)), 0ull, code) == 0ull;
}

// This rank's abort word: the first abort this rank learned of in the epoch (its own error's, or a peer's notice),
// non-zero once some rank of the ring (this one included) recorded an error. Only this rank's kernels write it: a
// notice that has landed and is not yet adopted is adopted here, by a local compare-and-swap from 0, so the word
// and every record this rank makes from it name the same abort even if a later rank's notice overwrites the notice.
// NOTES: relaxed, local - peers write only the notice, by remote sets; a wait needs only to see one eventually, and
// reads nothing of the failed rank because of it.
__device__ __forceinline__ u64 abort_word(const RingDesc& d) {
    u64* first = layout::status_word(d, layout::kStatusAbort);
    const u64 adopted = ptx::ld_relaxed_sys(first);
    if (adopted != 0) return adopted;
    const u64 notice = ptx::ld_relaxed_sys(layout::status_word(d, layout::kStatusAbortNotice));
    if (notice == 0) return 0;
    const u64 held = atomicCAS(reinterpret_cast<unsigned long long*>(first), 0ull, notice);
    return held != 0 ? held : notice;
}

// Tell every rank of the ring, this one too, that this rank failed (`word`: make_abort's). This rank's own abort
// word first: a notice that reached it earlier is adopted (abort_word), else its own error is, by a local
// compare-and-swap from 0 - so its record of which error came first holds. Then the notice into every rank's
// notice word: a non-fetching atomic set, issued and not awaited, so a rank that never answers holds back
// neither a later rank nor this kernel (a fetching operation to it would never return, and with it neither would
// this kernel, the device's synchronisation, Ring.check or Runtime.close). Each peer adopts the notice into its
// own abort word when one of its waits reads it. Then a quiet: every notice has landed before the kernel ends,
// hence before a reset can zero the words. NOTES: relaxed, no fence - an abort carries no payload (a peer only
// stops waiting; it reads nothing of ours because of it), so eventual visibility is all it needs
// (docs/PROTOCOL.md).
__device__ __noinline__ void raise_abort(const RingDesc& d, u64 word) {
    u64* notice = layout::status_word(d, layout::kStatusAbortNotice);
    if (abort_word(d) == 0)
        atomicCAS(reinterpret_cast<unsigned long long*>(layout::status_word(d, layout::kStatusAbort)), 0ull, word);
    for (u64 pe = 0; pe < d.world_size; ++pe) comm::signal_set_relaxed(notice, word, static_cast<int>(pe));
    comm::quiet();
}

// Copy a recorded error (`word`: an abort word naming its origin, code and epoch) into this rank's pinned host
// word, which the host reads at every call's entry (runtime/chunkring/ring/failure.py). NOTES: relaxed,
// system scope - the reader is the CPU, and it reads the word only to decide to synchronise: the record
// itself it reads after a device synchronisation, which orders everything this kernel wrote.
__device__ __forceinline__ void report_to_host(const RingDesc& d, u64 word) {
    if (d.failure_word != 0) ptx::st_relaxed_sys(reinterpret_cast<u64*>(d.failure_word), word);
}

__device__ __noinline__ void record_error(const RingDesc& d, ErrorCode code, Site site, u64 peer, u64 slot,
                                          u64 expected, u64 observed) {
    using namespace layout;
    const auto code_value = static_cast<unsigned long long>(code);
    if (!claim_first_record(d, kStatusCount, kStatusCode, code_value)) return;
    *status_word(d, kStatusPe) = d.my_pe;
    *status_word(d, kStatusPeer) = peer;
    *status_word(d, kStatusSlot) = slot;
    *status_word(d, kStatusExpected) = expected;
    *status_word(d, kStatusObserved) = observed;
    *status_word(d, kStatusSite) = static_cast<u64>(site);
    printf("chunkring: PE %llu error %llu at site %llu: peer %llu slot %llu expected 0x%llx observed 0x%llx\n",
           d.my_pe, code_value, static_cast<u64>(site), peer, slot, expected, observed);
    // A descriptor this device does not understand names no host word or peer list to trust: the host finds
    // it only by check().
    if (code == ErrorCode::kBadDescriptor) return;
    // A peer's abort is reported as the abort word that stopped the wait (it names the origin), and not
    // re-raised: its origin told every rank already.
    if (code == ErrorCode::kPeerAborted) {
        report_to_host(d, observed);
        return;
    }
    // NOTES: relaxed - the host wrote the epoch in the reset, stream-ordered before this kernel began.
    const u64 epoch = ptx::ld_relaxed_sys(layout::control_word(d, layout::kControlEpoch));
    const u64 word = make_abort(epoch, d.my_pe, code);
    report_to_host(d, word);  // first: the host learns even if an abort below waits on an unreachable rank
    raise_abort(d, word);
}

__device__ __forceinline__ bool check_descriptor(const RingDesc& d) {
    if (d.layout_version == layout::kRingLayoutVersion && d.desc_bytes == sizeof(RingDesc)) return true;
    if (threadIdx.x == 0) record_error(d, ErrorCode::kBadDescriptor, Site::kDescriptor, 0, 0, layout::kRingLayoutVersion, d.layout_version);
    return false;
}

// The one bounded spin: calls `poll(observed)` until it returns 1 (done) or -1 (it recorded an error).
// Gives up, returning false, when this rank already has an error; when a peer raised the abort word - then
// it records kPeerAborted (observed: the abort word, which names the failed rank); or after desc.timeout_ns -
// then it records a timeout naming the site, peer, slot and the last value observed. Caller: one thread.
// `deadline` (globaltimer ns, 0: now + desc.timeout_ns) lets one timeout bound several spins of one
// wait (poll_acked's, destination by destination).
template <typename Poll>
__device__ __forceinline__ bool spin_until(const RingDesc& d, Site site, u64 peer, u64 slot, u64 expected, Poll poll,
                                           u64 deadline = 0) {
    if (deadline == 0) deadline = ptx::globaltimer_ns() + d.timeout_ns;
    u64 observed = 0;
    for (u32 round = 0;; ++round) {
        const int verdict = poll(observed);  // 1 done, 0 keep waiting, -1 poll recorded an error
        if (verdict != 0) return verdict > 0;
        if ((round & 63u) == 63u) {
            if (has_error(d)) return false;
            // Every 64th poll, with the error word and the timer: two more local loads per 64 (the abort word
            // and, while it is 0, the notice) keep the poll loop's traffic what it was, and still stop within
            // microseconds of a peer's abort.
            if (const u64 abort = abort_word(d)) {
                record_error(d, ErrorCode::kPeerAborted, site, peer, slot, expected, abort);
                return false;
            }
            if (ptx::globaltimer_ns() > deadline) {
                record_error(d, ErrorCode::kTimeout, site, peer, slot, expected, observed);
                return false;
            }
        }
    }
}

}  // namespace chunkring::protocol
