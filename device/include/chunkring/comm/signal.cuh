// NVSHMEM signal and atomic calls, wrapped once under names that say what they (do not) order.
// Facts from NVSHMEM 3.4.5's headers (nvshmemi_signal_op in non_abi/device/common/
// nvshmemi_common_device.cuh; the wait and the AMOs in device/nvshmem_defines.h): signal SET is a plain
// volatile store and ADD a relaxed atomicAdd_system — neither fences; signal_wait_until is a volatile
// spin with no acquire after it (NVIDIA/nvshmem#75); atomic_or is a relaxed atomicOr_system, atomic_swap
// a relaxed atomicExch_system (device/nvshmem_defines.h, the P2P path). Callers
// add the fences; see protocol/.
#pragma once

#include "chunkring/comm/nvshmem.cuh"

namespace chunkring::comm {

using u64 = ::cuda::std::uint64_t;

// Relaxed remote store of `value` into `signal` on `pe`, non-fetching: issued, not awaited (complete at `pe`
// after a quiet()). NOTES: not a release by itself.
__device__ __forceinline__ void signal_set_relaxed(u64* signal, u64 value, int pe) {
    nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, pe);
}

// Spin until the local `signal` equals `value`. NOTES: no acquire; an acquire fence must follow.
__device__ __forceinline__ void signal_wait_eq_relaxed(u64* signal, u64 value) {
    nvshmem_signal_wait_until(signal, NVSHMEM_CMP_EQ, value);
}

// Relaxed remote OR of `bits` into `word` on `pe`. NOTES: a release fence must precede it.
__device__ __forceinline__ void atomic_or_relaxed(u64* word, u64 bits, int pe) {
    nvshmem_uint64_atomic_or(word, bits, pe);
}

// Relaxed remote swap: stores `value`, returns the value it replaced (a fetching AMO: complete at
// `pe` when it returns). NOTES: a release fence must precede it.
__device__ __forceinline__ u64 atomic_swap_relaxed(u64* word, u64 value, int pe) {
    return nvshmem_uint64_atomic_swap(word, value, pe);
}

}  // namespace chunkring::comm
