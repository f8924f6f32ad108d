"""The MoE kernels' argument structs, mirrored from device/include/chunkring/moe/kernel_args.cuh: each kernel of ten
or more parameters takes them as one struct by value (:class:`chunkring.jit.ArgStruct`), built here from named
tensors and integers and checked field by field at the launch as its loose parameters were. Each ``FIELDS`` lists
the header's words after ``version`` and ``bytes``, in its order, with the types the kernel reads them as
(tests/unit/test_kernel_args.py compares them)."""

from __future__ import annotations

from chunkring.jit import ArgStruct

__all__ = ["CombinePushArgs", "CombineReduceArgs", "DecodeL1Args", "DecodeL2Args", "LocalRouteArgs",
           "LocalScatterArgs", "PersistentGemmArgs", "PlanScatterArgs", "ProduceChunkArgs", "WaveGatherArgs"]


class LocalRouteArgs(ArgStruct):
    """``moe_local_route``: a one-rank call's routing (its row count and device count), the stage it goes into and the
    plan it fills but for the rows' payload."""

    FIELDS = """const RingDesc* desc, const StageDesc* stage, const int* topk_idx, const float* topk_weights,
                int n_tokens, CHUNKRING_NULLABLE const int* valid_tokens, int block_m, unsigned* counts,
                int* group_end, int* row_src, int* row_token, int* row_k, float* row_weight, int* own_row"""


class LocalScatterArgs(ArgStruct):
    """``moe_local_scatter``: a one-rank call's rows, straight into the plan rows ``moe_local_route`` gave them."""

    FIELDS = """const RingDesc* desc, const StageDesc* stage, const unsigned char* x,
                CHUNKRING_NULLABLE const float* x_sf, int n_tokens, CHUNKRING_NULLABLE const int* valid_tokens,
                int block_m, const int* group_end, const int* own_row, unsigned char* rows, float* rows_sf,
                long long sf_stride, long long plan_rows, int* row_src"""


class PlanScatterArgs(ArgStruct):
    """``moe_plan_scatter``: the stage's choices of local experts into the plan's groups."""

    FIELDS = """const StageDesc* stage, int block_m, const unsigned* counts, unsigned* cursors, unsigned char* rows,
                float* rows_sf, long long sf_stride, int* row_src, int* row_token, int* row_k, float* row_weight,
                int* group_end, int own_rank, int* own_row"""


class WaveGatherArgs(ArgStruct):
    """``moe_wave_gather``: a pool's claimed blocks into a plan (moe_plan_scatter's outputs)."""

    FIELDS = """const PoolDesc* pool_desc, const unsigned* counts, unsigned* cursors, unsigned char* rows,
                float* rows_sf, long long sf_stride, int* row_src, int* row_token, int* row_k, float* row_weight,
                int* group_end"""


class CombinePushArgs(ArgStruct):
    """``moe_combine_push``: each real row of the experts' output, weighted, to its source's combine buffer."""

    FIELDS = """__nv_bfloat16* out, const int* row_src, const int* row_token, const int* row_k,
                const float* row_weight, const unsigned* counts, int num_local, int block_m, long long hidden,
                int topk, const unsigned long long* peer_combine, CHUNKRING_NULLABLE const RingDesc* desc,
                CHUNKRING_NULLABLE __nv_bfloat16* combine, int own_rank, unsigned long long* pushed"""


class CombineReduceArgs(ArgStruct):
    """``moe_combine_reduce``: the owner's output, the sum over k of each routed choice's combine row."""

    FIELDS = """CHUNKRING_NULLABLE const RingDesc* desc, const __nv_bfloat16* combine, const int* routing,
                const float* weights, CHUNKRING_NULLABLE const int* own_row,
                CHUNKRING_NULLABLE const __nv_bfloat16* own_out, __nv_bfloat16* out, long long tokens, int topk,
                long long hidden"""


class DecodeL1Args(ArgStruct):
    """``moe_decode_l1``: L1 + SwiGLU + FP8 quantisation of the plan's rows. What a block reads before it waits for
    the kernel ahead (the weights, the counts, the shapes) first."""

    FIELDS = """const __nv_fp8_e4m3* w13, const float* w13_sf, long long sf_stride, const unsigned* counts,
                long long hidden, long long inter, const unsigned char* rows, const float* rows_sf,
                const int* group_end, __nv_fp8_e4m3* act, float* act_sf"""


class DecodeL2Args(ArgStruct):
    """``moe_decode_l2``: L2 of the activation L1 wrote, ordered as :class:`DecodeL1Args`."""

    FIELDS = """const __nv_fp8_e4m3* w2, const float* w2_sf, long long sf_stride, const unsigned* counts,
                long long hidden, long long inter, const __nv_fp8_e4m3* act, const float* act_sf,
                const int* group_end, __nv_bfloat16* out"""


class ProduceChunkArgs(ArgStruct):
    """``moe_produce_chunk``: the fused producer's chunk - the router's logits and the hidden rows - and its extent
    (:func:`chunkring.moe._engine.producer.enqueue_produce`)."""

    FIELDS = """const RingDesc* desc, const float* logits, const __nv_bfloat16* hidden, int num_experts, int n_tokens,
                long long token_base, int end_of_stream, CHUNKRING_NULLABLE const int* valid_tokens,
                long long batch_rows, CHUNKRING_NULLABLE unsigned* arrivals"""


class PersistentGemmArgs(ArgStruct):
    """``moe_persistent_gemm``: everything but its four tensor maps (passed by value beside it): the scales, the plan's
    groups, the shapes, the activation and output, the L1 -> L2 counters, the variant, the wait limit and where a block
    that gives up leaves its fault."""

    FIELDS = """const float* w13_sf, const float* w2_sf, const float* rows_sf, float* act_sf, const unsigned* counts,
                const int* group_end, int experts, long long hidden, long long inter, long long sf_stride,
                __nv_fp8_e4m3* act, __nv_bfloat16* out, unsigned* sync, int stages, int token_stages, int tile_cap,
                int claim, int phases, int w13_boxes, long long wait_limit_ns, unsigned long long fault_record,
                CHUNKRING_NULLABLE unsigned long long* timeline"""
