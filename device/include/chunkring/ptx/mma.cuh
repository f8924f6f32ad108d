// Tensor-core matrix multiply-accumulate, warp-wide (PTX `mma.sync`). Every `asm` of chunkring lives in ptx/.
#pragma once

#include <cuda/std/cstdint>

namespace chunkring::ptx {

// c[16x8] += a[16x16] * b[16x8]: bf16 inputs, fp32 accumulation (m16n8k16, A row-major, B column-major).
// Fragments, with g = lane / 4 and t = lane % 4, each u32 holding two bf16 (the lower column in the low half):
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1]                          c[2..3] = C[g+8][2t..2t+1]
// The hardware's order of the k sums is fixed, so the same fragments always give the same bits.
__device__ __forceinline__ void mma_m16n8k16_bf16_f32(float (&c)[4], const ::cuda::std::uint32_t (&a)[4],
                                                      const ::cuda::std::uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[16x8] += a[16x32] * b[32x8]: FP8 e4m3 inputs, fp32 accumulation (m16n8k32, A row-major, B column-major;
// sm_89 and later, so plain sm_90 - no `a` variant). The decode GEMM (moe/decode_gemm.cuh) puts 16 weight
// rows in A and 8 tokens in B: the wide side of the MMA is the side with many rows. Fragments, with
// g = lane / 4 and t = lane % 4, each u32 holding four e4m3 (the lowest k in the low byte):
//   a[0] = A[g][4t..4t+3]     a[1] = A[g+8][4t..4t+3]   a[2] = A[g][4t+16..4t+19]   a[3] = A[g+8][4t+16..4t+19]
//   b[0] = B[4t..4t+3][g]     b[1] = B[4t+16..4t+19][g]
//   c[0..1] = C[g][2t..2t+1]                            c[2..3] = C[g+8][2t..2t+1]
// Only the pairing of a k between A and B matters to the sum, so a caller may feed both operands the
// same permutation of k (the decode GEMM does, to load each fragment with 16-byte loads: it relies only on
// a[0], a[1] holding b[0]'s k and a[2], a[3] holding b[1]'s, lane by lane and byte by byte). Like DeepGEMM,
// callers accumulate one 128-wide k block per fresh `c` and add it to an fp32 total with its scales: the
// tensor core's FP8 accumulation is not a full fp32 sum over long k.
__device__ __forceinline__ void mma_m16n8k32_e4m3_f32(float (&c)[4], const ::cuda::std::uint32_t (&a)[4],
                                                      const ::cuda::std::uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace chunkring::ptx
