"""The ring kernels' argument structs, mirrored from device/include/chunkring/layout/ring_args.cuh: each kernel of ten
or more parameters takes them as one struct by value (:class:`chunkring.jit.ArgStruct`), built here from named tensors
and integers and checked field by field at the launch as its loose parameters were. Each ``FIELDS`` lists the
header's words after ``version`` and ``bytes``, in its order, with the types the kernel reads them as
(tests/unit/test_kernel_args.py compares them)."""

from __future__ import annotations

from chunkring.jit import ArgStruct

__all__ = ["RingPublishArgs", "RingStressArgs"]


class RingPublishArgs(ArgStruct):
    """``ring_publish_tensors`` and ``ring_publish_copy``: a chunk's rows and its extent (:func:`chunkring.ring.io.
    publish_chunk`)."""

    FIELDS = """const RingDesc* desc, const unsigned char* x, const float* x_sf, const int* topk_idx,
                const float* topk_weights, int n_tokens, long long token_base, int end_of_stream,
                CHUNKRING_NULLABLE const int* valid_tokens, long long batch_rows"""


class RingStressArgs(ArgStruct):
    """``ring_stress``: the protocol stress kernel's plan and scratch (:mod:`chunkring.testing.stress`)."""

    FIELDS = """const RingDesc* desc, const int* plan, int invocations, u64 seed, unsigned max_delay_ns,
                unsigned long long* received, u64* stress, u64 stress_words, CHUNKRING_NULLABLE unsigned* arrivals,
                int consumer_blocks"""
