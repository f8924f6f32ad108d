// Asynchronous copies into shared memory (PTX `cp.async`), per thread (bulk_copy.cuh: the copy engine's). Every
// `asm` of chunkring lives in ptx/.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

// 16 bytes of global memory copied asynchronously into shared memory (`cp.async.cg`: cached in L2 only, so a
// weight byte read once by one warp allocates nothing in L1). The copy is this thread's: it is complete and
// visible to this thread once a cp_async_wait covers the group it was committed in. "memory" clobber: the
// compiler must not move the shared-memory reads of a slot past the copy that refills it.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global) {
    const auto to = static_cast<::cuda::std::uint32_t>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global) : "memory");
}

// Closes this thread's group of cp.async copies issued since the last commit (an empty group is a group too).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `kPending` of this thread's committed groups are still in flight: every older group's
// copies have landed and are visible to this thread.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

}  // namespace chunkring::ptx
