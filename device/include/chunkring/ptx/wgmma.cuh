// Warpgroup matrix multiply-accumulate (PTX `wgmma`, sm_90a only: a source that uses it is built for the
// architecture-specific target, chunkring.jit.compiler.ARCH_SPECIFIC_SOURCES). Every `asm` of chunkring lives in ptx/.
//
// A warpgroup - 4 consecutive warps from a warp index divisible by 4 - issues one `wgmma.mma_async` together: D
// (M x N, fp32, in the 128 threads' registers) += A (M x K) * B^T (N x K), both operands read from shared memory
// through 64-bit matrix descriptors. The FP8 shapes used here are m64nNk32, e4m3 x e4m3 -> f32, both operands
// K-major (FP8 takes no transpose): the layout the copy engine leaves when it copies boxes of 128-byte rows with
// 128-byte swizzling (bulk_copy.cuh) - so the weights go in as the checkpoint stores them, rows of K bytes.
//
// Accumulator layout (the PTX ISA's "wgmma D fragment", f32): warp w of the warpgroup holds rows 16w .. 16w + 15;
// lane l (g = l / 4, t = l % 4) holds, for each 8-column chunk j, d[4j + 0] = (16w + g, 8j + 2t),
// d[4j + 1] = (16w + g, 8j + 2t + 1), d[4j + 2] = (16w + g + 8, 8j + 2t), d[4j + 3] = (16w + g + 8, 8j + 2t + 1).
//
// Ordering, as the ISA asks: wgmma_fence before the first wgmma of a batch whose accumulators other instructions
// wrote or read since the last one; wgmma_commit_group closes the batch; wgmma_wait_group<n> returns once at most n
// batches are in flight, their shared-memory reads done. The accumulators are the asm's "+f" operands, but the
// compiler does not know that a later wait is what makes them final: wgmma_fence_operands after the wait keeps every
// read of them below it.
//
// NOTES: hand-written rather than CUTLASS's (cute/arch/mma_sm90_gmma.hpp, which NVRTC compiles here from the
// DeepGEMM wheel): four shapes are 50 lines, and the cache key (chunkring.jit.compiler.headers_digest) covers only
// headers of this tree and the toolkit's, not a wheel's.
#pragma once

#include <cuda/std/cstdint>

#include "chunkring/ptx/mbarrier.cuh"

namespace chunkring::ptx {

// Accumulator registers per thread of an m64nN wgmma: 64 * N / 128.
template <int N>
constexpr int kAccumulators = N / 2;

// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 the start address / 16, 16-29
// the leading-dimension byte offset / 16, 32-45 the stride-dimension byte offset / 16, 49-51 the base offset, 62-63
// the swizzle (1: 128-byte). For a K-major tile of 128-byte rows swizzled by 128 bytes - a copy-engine box whose rows
// are 128 bytes, at a 1024-byte boundary - the 8-row core groups lie 1024 bytes apart (the stride offset), the
// leading offset is unused (one swizzle atom spans the whole K of a row), and the base offset is 0.
constexpr u32 kSwizzle128RowBytes = 128;
constexpr u32 kSwizzle128AtomBytes = 8 * kSwizzle128RowBytes;  // 8 rows: the span of the swizzle pattern

constexpr __host__ __device__ u64 smem_desc_k_major_sw128(u32 shared_addr) {
    return (static_cast<u64>((shared_addr >> 4) & 0x3FFFu)) | (static_cast<u64>(kSwizzle128AtomBytes >> 4) << 32) |
           (static_cast<u64>(1) << 62);
}

// The descriptor of the same tile `bytes` further along K (within its 128-byte rows: 32 per k32 step of FP8). The
// swizzle is a function of the address, so an offset inside the atom's rows needs only the start address moved.
constexpr __host__ __device__ u64 smem_desc_advance(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

static_assert(smem_desc_k_major_sw128(0) == 0x4000004000000000ull, "SBO 1024 bytes, 128-byte swizzle");
static_assert(smem_desc_k_major_sw128(0x10400) == 0x4000004000001040ull, "the start address in units of 16 bytes");
static_assert(smem_desc_advance(smem_desc_k_major_sw128(0x10400), 96) == 0x4000004000001046ull,
              "k32 step 3 of a 128-byte row: 96 bytes on");

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(kPending >= 0 && kPending <= 7, "wgmma.wait_group takes 0-7");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses to `d` across this point (see the top).
template <int kCount>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kCount]) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (+)= A * B^T, m64nNk32, e4m3 operands from shared memory (descriptors `a`: 64 rows, `b`: N rows, both K-major,
// 128-byte swizzled), fp32 accumulators; `accumulate` false overwrites D (the ISA's scale-d). One per N; wider
// token tiles run as several (a caller's accumulators for N = 128 would leave too few registers beside them).
// m64n8k32: d[0 .. 4) (kAccumulators<8>).
__device__ __forceinline__ void wgmma_m64n8k32_e4m3_f32(float (&d)[4], u64 a, u64 b, bool accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %6, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3"
        "}, %4, %5, p, 1, 1;\n\t}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(static_cast<u32>(accumulate))
        : "memory");
}

// m64n16k32: d[0 .. 8) (kAccumulators<16>).
__device__ __forceinline__ void wgmma_m64n16k32_e4m3_f32(float (&d)[8], u64 a, u64 b, bool accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %10, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, p, 1, 1;\n\t}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b), "r"(static_cast<u32>(accumulate))
        : "memory");
}

// m64n32k32: d[0 .. 16) (kAccumulators<32>).
__device__ __forceinline__ void wgmma_m64n32k32_e4m3_f32(float (&d)[16], u64 a, u64 b, bool accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1;\n\t}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(static_cast<u32>(accumulate))
        : "memory");
}

// m64n64k32: d[0 .. 32) (kAccumulators<64>).
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_f32(float (&d)[32], u64 a, u64 b, bool accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1;\n\t}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(static_cast<u32>(accumulate))
        : "memory");
}

// The shape for a compile-time N: the one of the four above.
template <int N>
__device__ __forceinline__ void wgmma_m64k32_e4m3_f32(float (&d)[kAccumulators<N>], u64 a, u64 b, bool accumulate) {
    static_assert(N == 8 || N == 16 || N == 32 || N == 64, "N of 8, 16, 32 or 64");
    if constexpr (N == 8) wgmma_m64n8k32_e4m3_f32(d, a, b, accumulate);
    if constexpr (N == 16) wgmma_m64n16k32_e4m3_f32(d, a, b, accumulate);
    if constexpr (N == 32) wgmma_m64n32k32_e4m3_f32(d, a, b, accumulate);
    if constexpr (N == 64) wgmma_m64n64k32_e4m3_f32(d, a, b, accumulate);
}

}  // namespace chunkring::ptx
