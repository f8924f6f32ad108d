// The weight-read probe's argument struct (layout/kernel_args.cuh: 64-bit words, version and size first, each field
// read as the type its comment names with arg<T>). Mirrored field for field by benchmarks/probe_weight_read.py
// ProbeWeightReadArgs; what each field holds is told at the kernel (device/kernels/probe_weight_read.cu), whose tensor
// maps stay parameters of their own (the copy engine reads each where the launch put it).
#pragma once

#include "chunkring/layout/kernel_args.cuh"

namespace chunkring::moe {

using layout::u64;

// probe_weight_read (probe_weight_read.cu), after its two tensor maps.
struct ProbeWeightReadArgs {
    u64 version;        // kKernelArgsVersion
    u64 bytes;          // sizeof(ProbeWeightReadArgs)
    u64 w13;            // const __nv_fp8_e4m3*
    u64 w2;             // const __nv_fp8_e4m3*
    u64 experts;        // const int*
    u64 num_read;       // int
    u64 hidden;         // long long
    u64 inter;          // long long
    u64 box_rows;       // int
    u64 box_cols;       // int
    u64 stages;         // int
    u64 loader;         // int
    u64 claim;          // int
    u64 claim_counter;  // CHUNKRING_NULLABLE unsigned*
    u64 wait_limit_ns;  // long long
    u64 out;            // unsigned long long*
};
static_assert(sizeof(ProbeWeightReadArgs) == 16 * sizeof(u64), "ProbeWeightReadArgs: benchmarks/probe_weight_read.py");

}  // namespace chunkring::moe
