// The ring kernels' argument structs (kernel_args.cuh: 64-bit words, version and size first, each field read as the
// type its comment names with arg<T>). Mirrored field for field by runtime/chunkring/ring/kernel_args.py; what each
// field holds is told at its kernel.
#pragma once

#include "chunkring/layout/kernel_args.cuh"

namespace chunkring::layout {

// ring_publish_tensors and ring_publish_copy (ring_host_api.cu): the same publish, in one block or as the split
// publish's copy; its open and close take the chunk's extent alone (valid_tokens and below).
struct RingPublishArgs {
    u64 version;        // kKernelArgsVersion
    u64 bytes;          // sizeof(RingPublishArgs)
    u64 desc;           // const RingDesc*
    u64 x;              // const unsigned char*
    u64 x_sf;           // const float*
    u64 topk_idx;       // const int*
    u64 topk_weights;   // const float*
    u64 n_tokens;       // int
    u64 token_base;     // long long
    u64 end_of_stream;  // int
    u64 valid_tokens;   // CHUNKRING_NULLABLE const int*
    u64 batch_rows;     // long long
};
static_assert(sizeof(RingPublishArgs) == 12 * sizeof(u64), "RingPublishArgs: runtime/chunkring/ring/kernel_args.py");

// ring_stress (ring_stress.cu).
struct RingStressArgs {
    u64 version;          // kKernelArgsVersion
    u64 bytes;            // sizeof(RingStressArgs)
    u64 desc;             // const RingDesc*
    u64 plan;             // const int*
    u64 invocations;      // int
    u64 seed;             // u64
    u64 max_delay_ns;     // unsigned
    u64 received;         // unsigned long long*
    u64 stress;           // u64*
    u64 stress_words;     // u64
    u64 arrivals;         // CHUNKRING_NULLABLE unsigned*
    u64 consumer_blocks;  // int
};
static_assert(sizeof(RingStressArgs) == 12 * sizeof(u64), "RingStressArgs: runtime/chunkring/ring/kernel_args.py");

}  // namespace chunkring::layout
