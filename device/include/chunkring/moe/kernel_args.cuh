// The MoE kernels' argument structs (layout/kernel_args.cuh: 64-bit words, version and size first, each field read
// as the type its comment names with arg<T>). Mirrored field for field by
// runtime/chunkring/moe/_engine/kernel_args.py; what each field holds is told at its kernel.
#pragma once

#include "chunkring/layout/kernel_args.cuh"

namespace chunkring::moe {

using layout::u64;

// moe_local_route (moe_stream.cu): a one-rank call's routing, into the stage and the plan's groups.
struct LocalRouteArgs {
    u64 version;       // kKernelArgsVersion
    u64 bytes;         // sizeof(LocalRouteArgs)
    u64 desc;          // const RingDesc*
    u64 stage;         // const StageDesc*
    u64 topk_idx;      // const int*
    u64 topk_weights;  // const float*
    u64 n_tokens;      // int
    u64 valid_tokens;  // CHUNKRING_NULLABLE const int*
    u64 block_m;       // int
    u64 counts;        // unsigned*
    u64 group_end;     // int*
    u64 row_src;       // int*
    u64 row_token;     // int*
    u64 row_k;         // int*
    u64 row_weight;    // float*
    u64 own_row;       // int*
};
static_assert(sizeof(LocalRouteArgs) == 16 * sizeof(u64),
              "LocalRouteArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_local_scatter (moe_stream.cu): a one-rank call's rows, straight into the plan.
struct LocalScatterArgs {
    u64 version;       // kKernelArgsVersion
    u64 bytes;         // sizeof(LocalScatterArgs)
    u64 desc;          // const RingDesc*
    u64 stage;         // const StageDesc*
    u64 x;             // const unsigned char*
    u64 x_sf;          // CHUNKRING_NULLABLE const float*
    u64 n_tokens;      // int
    u64 valid_tokens;  // CHUNKRING_NULLABLE const int*
    u64 block_m;       // int
    u64 group_end;     // const int*
    u64 own_row;       // const int*
    u64 rows;          // unsigned char*
    u64 rows_sf;       // float*
    u64 sf_stride;     // long long
    u64 plan_rows;     // long long
    u64 row_src;       // int*
};
static_assert(sizeof(LocalScatterArgs) == 16 * sizeof(u64),
              "LocalScatterArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_plan_scatter (moe_experts.cu).
struct PlanScatterArgs {
    u64 version;     // kKernelArgsVersion
    u64 bytes;       // sizeof(PlanScatterArgs)
    u64 stage;       // const StageDesc*
    u64 block_m;     // int
    u64 counts;      // const unsigned*
    u64 cursors;     // unsigned*
    u64 rows;        // unsigned char*
    u64 rows_sf;     // float*
    u64 sf_stride;   // long long
    u64 row_src;     // int*
    u64 row_token;   // int*
    u64 row_k;       // int*
    u64 row_weight;  // float*
    u64 group_end;   // int*
    u64 own_rank;    // int
    u64 own_row;     // int*
};
static_assert(sizeof(PlanScatterArgs) == 16 * sizeof(u64),
              "PlanScatterArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_wave_gather (moe_experts.cu): moe_plan_scatter's outputs, filled from a pool's claimed blocks.
struct WaveGatherArgs {
    u64 version;     // kKernelArgsVersion
    u64 bytes;       // sizeof(WaveGatherArgs)
    u64 pool_desc;   // const PoolDesc*
    u64 counts;      // const unsigned*
    u64 cursors;     // unsigned*
    u64 rows;        // unsigned char*
    u64 rows_sf;     // float*
    u64 sf_stride;   // long long
    u64 row_src;     // int*
    u64 row_token;   // int*
    u64 row_k;       // int*
    u64 row_weight;  // float*
    u64 group_end;   // int*
};
static_assert(sizeof(WaveGatherArgs) == 13 * sizeof(u64),
              "WaveGatherArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_combine_push (moe_experts.cu).
struct CombinePushArgs {
    u64 version;       // kKernelArgsVersion
    u64 bytes;         // sizeof(CombinePushArgs)
    u64 out;           // __nv_bfloat16*
    u64 row_src;       // const int*
    u64 row_token;     // const int*
    u64 row_k;         // const int*
    u64 row_weight;    // const float*
    u64 counts;        // const unsigned*
    u64 num_local;     // int
    u64 block_m;       // int
    u64 hidden;        // long long
    u64 topk;          // int
    u64 peer_combine;  // const unsigned long long*
    u64 desc;          // CHUNKRING_NULLABLE const RingDesc*
    u64 combine;       // CHUNKRING_NULLABLE __nv_bfloat16*
    u64 own_rank;      // int
    u64 pushed;        // unsigned long long*
};
static_assert(sizeof(CombinePushArgs) == 17 * sizeof(u64),
              "CombinePushArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_combine_reduce (moe_experts.cu).
struct CombineReduceArgs {
    u64 version;  // kKernelArgsVersion
    u64 bytes;    // sizeof(CombineReduceArgs)
    u64 desc;     // CHUNKRING_NULLABLE const RingDesc*
    u64 combine;  // const __nv_bfloat16*
    u64 routing;  // const int*
    u64 weights;  // const float*
    u64 own_row;  // CHUNKRING_NULLABLE const int*
    u64 own_out;  // CHUNKRING_NULLABLE const __nv_bfloat16*
    u64 out;      // __nv_bfloat16*
    u64 tokens;   // long long
    u64 topk;     // int
    u64 hidden;   // long long
};
static_assert(sizeof(CombineReduceArgs) == 12 * sizeof(u64),
              "CombineReduceArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_decode_l1 (moe_decode.cu). The fields a block reads before it waits for the kernel ahead come first.
struct DecodeL1Args {
    u64 version;    // kKernelArgsVersion
    u64 bytes;      // sizeof(DecodeL1Args)
    u64 w13;        // const __nv_fp8_e4m3*
    u64 w13_sf;     // const float*
    u64 sf_stride;  // long long
    u64 counts;     // const unsigned*
    u64 hidden;     // long long
    u64 inter;      // long long
    u64 rows;       // const unsigned char*
    u64 rows_sf;    // const float*
    u64 group_end;  // const int*
    u64 act;        // __nv_fp8_e4m3*
    u64 act_sf;     // float*
};
static_assert(sizeof(DecodeL1Args) == 13 * sizeof(u64),
              "DecodeL1Args: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_decode_l2 (moe_decode.cu), ordered as DecodeL1Args.
struct DecodeL2Args {
    u64 version;    // kKernelArgsVersion
    u64 bytes;      // sizeof(DecodeL2Args)
    u64 w2;         // const __nv_fp8_e4m3*
    u64 w2_sf;      // const float*
    u64 sf_stride;  // long long
    u64 counts;     // const unsigned*
    u64 hidden;     // long long
    u64 inter;      // long long
    u64 act;        // const __nv_fp8_e4m3*
    u64 act_sf;     // const float*
    u64 group_end;  // const int*
    u64 out;        // __nv_bfloat16*
};
static_assert(sizeof(DecodeL2Args) == 12 * sizeof(u64),
              "DecodeL2Args: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_produce_chunk (moe_produce.cu).
struct ProduceChunkArgs {
    u64 version;        // kKernelArgsVersion
    u64 bytes;          // sizeof(ProduceChunkArgs)
    u64 desc;           // const RingDesc*
    u64 logits;         // const float*
    u64 hidden;         // const __nv_bfloat16*
    u64 num_experts;    // int
    u64 n_tokens;       // int
    u64 token_base;     // long long
    u64 end_of_stream;  // int
    u64 valid_tokens;   // CHUNKRING_NULLABLE const int*
    u64 batch_rows;     // long long
    u64 arrivals;       // CHUNKRING_NULLABLE unsigned*
};
static_assert(sizeof(ProduceChunkArgs) == 12 * sizeof(u64),
              "ProduceChunkArgs: runtime/chunkring/moe/_engine/kernel_args.py");

// moe_persistent_gemm (moe_persistent.cu): everything but its four tensor maps, which it takes by value beside this.
struct PersistentGemmArgs {
    u64 version;        // kKernelArgsVersion
    u64 bytes;          // sizeof(PersistentGemmArgs)
    u64 w13_sf;         // const float*
    u64 w2_sf;          // const float*
    u64 rows_sf;        // const float*
    u64 act_sf;         // float*
    u64 counts;         // const unsigned*
    u64 group_end;      // const int*
    u64 experts;        // int
    u64 hidden;         // long long
    u64 inter;          // long long
    u64 sf_stride;      // long long
    u64 act;            // __nv_fp8_e4m3*
    u64 out;            // __nv_bfloat16*
    u64 sync;           // unsigned*
    u64 stages;         // int
    u64 token_stages;   // int
    u64 tile_cap;       // int
    u64 claim;          // int
    u64 phases;         // int
    u64 w13_boxes;      // int
    u64 wait_limit_ns;  // long long
    u64 fault_record;   // unsigned long long
    u64 timeline;       // CHUNKRING_NULLABLE unsigned long long*
};
static_assert(sizeof(PersistentGemmArgs) == 24 * sizeof(u64),
              "PersistentGemmArgs: runtime/chunkring/moe/_engine/kernel_args.py");

}  // namespace chunkring::moe
