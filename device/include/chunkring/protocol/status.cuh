// Error reporting for protocol kernels: the first error a rank's kernels see is recorded in its
// status region (code, PE, peer, slot, expected and observed values, site) and printed once; the
// kernel then returns instead of trapping, so the host can read the record and raise
// (runtime/ring/status.py) and the CUDA context stays usable. Every spin-wait also stops once its rank
// has an error, so one failure ends the whole kernel quickly.
#pragma once


#include "chunkring/layout/ring_desc.cuh"
#include "chunkring/ptx/ordering.cuh"

namespace chunkring::protocol {

using layout::RingDesc;

// Append-only; mirrored by runtime/ring/status.py ErrorCode.
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
};

// Where a wait or check happened; append-only, mirrored by runtime/ring/status.py Site.
enum class Site : unsigned long long {
    kNone = 0, kWaitRoute = 1, kWaitLayout = 2, kWaitReusable = 3, kAck = 4, kPayload = 5, kDescriptor = 6, kPublish = 7,
    kWaitPushed = 8,  // moe_ack_held waiting for every combine-push block's arrival (values: block counts)
};

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
}

__device__ __forceinline__ bool check_descriptor(const RingDesc& d) {
    if (d.layout_version == layout::kRingLayoutVersion && d.desc_bytes == sizeof(RingDesc)) return true;
    if (threadIdx.x == 0) record_error(d, ErrorCode::kBadDescriptor, Site::kDescriptor, 0, 0, layout::kRingLayoutVersion, d.layout_version);
    return false;
}

// The one bounded spin: calls `poll(observed)` until it returns 1 (done) or -1 (it recorded an error).
// Gives up, returning false, when this rank already has an error or after desc.timeout_ns - then it
// records a timeout naming the site, peer, slot and the last value observed. Caller: one thread.
// `deadline` (globaltimer ns, 0: now + desc.timeout_ns) lets one timeout bound several spins of one
// wait (wait_acked's, destination by destination).
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
            if (ptx::globaltimer_ns() > deadline) {
                record_error(d, ErrorCode::kTimeout, site, peer, slot, expected, observed);
                return false;
            }
        }
    }
}

}  // namespace chunkring::protocol
