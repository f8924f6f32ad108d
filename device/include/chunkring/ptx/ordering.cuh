// Memory-ordering primitives, named <operation>_<order>_<scope>. Every `asm` of chunkring lives in ptx/.
//
// Scope: every word chunkring's protocol touches is written by one GPU (or process) and read by
// another, so the protocol uses `.sys` scope throughout; the PTX memory model only pairs a release
// with an acquire across GPUs when both sides use `.sys`. Every statement carries a "memory" clobber
// so the compiler cannot move ordinary loads and stores across it.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

using u32 = ::cuda::std::uint32_t;
using u64 = ::cuda::std::uint64_t;

__device__ __forceinline__ u64 ld_relaxed_sys(const u64* ptr) {
    u64 value;
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void st_relaxed_sys(u64* ptr, u64 value) {
    asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// A release or acquire *fence*: with a relaxed (or NVSHMEM's volatile) store after it, it forms a
// release pattern; with a relaxed load before it, an acquire pattern (PTX ISA, memory consistency model).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// The same fence at GPU scope: for orderings between blocks of one kernel on one GPU.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// 32-bit words of one GPU's own memory, read and written by blocks of kernels on that GPU only (the MoE
// consumer's incremental expert blocks, chunkring/moe/blocks.cuh): GPU scope suffices there.
__device__ __forceinline__ u32 ld_relaxed_gpu(const u32* ptr) {
    u32 value;
    asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void st_relaxed_gpu(u32* ptr, u32 value) {
    asm volatile("st.relaxed.gpu.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ u32 ld_acquire_gpu(const u32* ptr) {
    u32 value;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void st_release_gpu(u32* ptr, u32 value) {
    asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Adds to a 32-bit word of one GPU's memory, with release semantics at GPU scope: whoever acquires the sum sees what
// this thread wrote, or saw, before it (the persistent decode consumer's L1 -> L2 counters).
__device__ __forceinline__ void red_add_release_gpu(u32* ptr, u32 value) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Adds and returns the word's value before, acquire and release at GPU scope.
__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* ptr, u32 value) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

// Orders this thread's accesses to global memory through the generic proxy (ordinary loads and stores) with those
// of the async proxy (the copy engine's bulk copies): a row written with ordinary stores that a bulk copy reads
// next needs it on the writer's side before the release, and on the reader's after the acquire.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Nanoseconds from the global timer. Watchdogs use it rather than clock64(), whose rate varies.
__device__ __forceinline__ u64 globaltimer_ns() {
    u64 ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns) : : "memory");
    return ns;
}

}  // namespace chunkring::ptx
