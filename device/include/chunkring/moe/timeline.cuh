// The MoE layer's timeline (runtime/chunkring/moe/timeline.py reads it): device timestamps of chunk events,
// appended to a buffer only when the caller passes one. Event values are runtime/chunkring/moe/timeline.py's Event.
//   buffer [1 + 4 * capacity] int64: buffer[0] counts the appends tried (past capacity they are counted,
//   not stored, so the host can say how many were lost); record i = (event, src, chunk, globaltimer ns).
#pragma once

#include "chunkring/ptx/ordering.cuh"

namespace chunkring::moe::timeline {

enum Event : long long {
    kProduceBegin = 0,
    kPublished = 1,
    kObserved = 2,
    kPulled = 3,
    kAcked = 4,
    kExpertsBegin = 5,
    kExpertsDone = 6,
    kCombineDone = 7,
    kDrained = 8,
    kOutputDone = 9,
    kCallBegin = 10,
};

// One thread appends one record; a null buffer (tracing off) costs a branch. %globaltimer is one
// nanosecond clock per GPU, the same for every SM and every process on that GPU.
__device__ __forceinline__ void record(long long* buffer, long long capacity, Event event, long long src,
                                       long long chunk) {
    if (buffer == nullptr) return;
    const auto t = static_cast<long long>(ptx::globaltimer_ns());
    const auto i = static_cast<long long>(atomicAdd(reinterpret_cast<unsigned long long*>(buffer), 1ull));
    if (i >= capacity) return;
    long long* r = buffer + 1 + 4 * i;
    r[0] = event;
    r[1] = src;
    r[2] = chunk;
    r[3] = t;
}

}  // namespace chunkring::moe::timeline
