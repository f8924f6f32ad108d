// The layer's FP8 arithmetic, written once: the e4m3 range, the 1x128 block scale and SwiGLU. The producers'
// payload quantisation (moe_produce.cu), the activation's (moe_experts.cu) and the decode L1's epilogue
// (moe_decode.cu) use these, so a row quantised by any of them has the same bits.
#pragma once

#include <cuda_fp8.h>

namespace chunkring::moe {

constexpr float kE4M3Max = 448.0f;  // largest finite float8_e4m3fn

// The scale of a 1x128 block whose absolute maximum is `amax`: the maximum maps to kE4M3Max. A zero block (or
// one whose scale underflows to 0) gets scale 1, so dequantising never divides by zero.
__device__ __forceinline__ float e4m3_scale(float amax) {
    const float scale = amax / kE4M3Max;
    return scale > 0.0f ? scale : 1.0f;
}

// `y` (a value already divided by its block's scale) clamped to e4m3's finite range; NaN comes out as
// -kE4M3Max (fmaxf drops it), which a caller that must keep NaN tests before.
__device__ __forceinline__ float clamp_e4m3(float y) { return fminf(fmaxf(y, -kE4M3Max), kE4M3Max); }

// SwiGLU's product silu(gate) * up in fp32, with the fast exponential every kernel of the layer uses.
__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.0f + __expf(-gate)) * up; }

}  // namespace chunkring::moe
