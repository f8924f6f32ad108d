// Where a block's warps run and what registers they hold: the SM a thread runs on, and warpgroup register
// reallocation (`setmaxnreg`, sm_90a only: a source that calls it is built for the architecture-specific target,
// chunkring.jit.compiler.ARCH_SPECIFIC_SOURCES). Every `asm` of chunkring lives in ptx/.
//
// setmaxnreg: every warp of a warpgroup (4 consecutive warps from a warp index divisible by 4) executes the same
// one, and the kernel has a register cap at entry (`__launch_bounds__(threads, 1)`), which ptxas then allocates
// whole: the warpgroups that give registers back (dec) let those that ask (inc) take them. The counts are
// multiples of 8 in [24, 256].
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

// The SM this thread runs on (%smid: in [0, the GPU's SM count) on Hopper).
__device__ __forceinline__ ::cuda::std::uint32_t sm_id() {
    ::cuda::std::uint32_t id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// Waits until `threads` threads (a multiple of 32, whole warps) have arrived at named barrier `id` (1-15; 0 is
// __syncthreads'): a barrier among some warps of a block - the persistent decode consumer's two math warpgroups -
// that the others never join. It orders their shared-memory accesses as __syncthreads does.
__device__ __forceinline__ void named_barrier_sync(::cuda::std::uint32_t id, ::cuda::std::uint32_t threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg's range");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters) : "memory");
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg's range");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters) : "memory");
}

}  // namespace chunkring::ptx
