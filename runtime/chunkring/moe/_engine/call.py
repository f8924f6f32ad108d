"""A MoE layer call's arguments, checked once at the public boundary, before anything is enqueued.

:meth:`MoELayer.run` and :meth:`MoELayer.forward` call these; nothing downstream checks again (the
layer publishes slices of a checked batch through :func:`chunkring.ring.io.enqueue_publish`). They need
no GPU: tests drive them with CPU tensors.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.experts import check_expert_weights
from chunkring.moe.timeline import Timeline
from chunkring.ring.io import check_row_aligned, check_tensor
from chunkring.ring.spec import FP8_SCALE_BLOCK

if TYPE_CHECKING:
    from chunkring.moe.auto import StreamingCalibration
    from chunkring.moe.config import MoEConfig
    from chunkring.moe.weights import Fp8Weight

__all__ = ["CallMode", "call_chunk", "check_forward_args", "check_run_args", "resolve_streaming"]


class CallMode(enum.Enum):
    """How a call hands its batch to the consumers, and so which of the layer's rings it uses."""

    #: The whole batch as one chunk into a one-slot ring of ``max_tokens_per_rank`` rows: the full
    #: per-rank input region of today's MegaMoE contract. The default, and the correctness fallback.
    BATCH_READY = "batch_ready"
    #: Chunk by chunk into the ``front_num_slots`` x ``front_tokens_per_slot`` ring, each chunk as soon
    #: as its producers finish.
    STREAMED = "streamed"


def check_run_args(config: MoEConfig, experts_per_rank: int, device: torch.device,
                   calibration: StreamingCalibration | None, x: torch.Tensor, x_sf: torch.Tensor | None,
                   topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor | Fp8Weight,
                   w2: torch.Tensor | Fp8Weight, *, streaming: bool | str, out: torch.Tensor | None,
                   num_tokens: torch.Tensor | None, timeline: Timeline | None) -> tuple[CallMode, int]:
    """:meth:`MoELayer.run`'s arguments: the call's mode and token count, or a ``ChunkringUsageError``
    naming the first bad argument."""
    fp8 = config.payload.has_scales
    n = _check_batch(config, device, "x", x, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    if fp8:
        check_tensor("x_sf", x_sf, (n, config.hidden // FP8_SCALE_BLOCK), torch.float32, device)
    elif x_sf is not None:
        raise ChunkringUsageError("bf16 payloads carry no scales; pass None", field="x_sf")
    check_tensor("topk_idx", topk_idx, (n, config.topk), torch.int32, device)
    check_tensor("topk_weights", topk_weights, (n, config.topk), torch.float32, device)
    return _check_common(config, experts_per_rank, device, calibration, n, w13, w2, streaming, out, num_tokens,
                         timeline), n


def check_forward_args(config: MoEConfig, experts_per_rank: int, device: torch.device,
                       calibration: StreamingCalibration | None, hidden: torch.Tensor, router_weight: torch.Tensor,
                       w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, *, streaming: bool | str,
                       out: torch.Tensor | None, num_tokens: torch.Tensor | None,
                       timeline: Timeline | None) -> tuple[CallMode, int]:
    """:meth:`MoELayer.forward`'s arguments, as :func:`check_run_args`."""
    n = _check_batch(config, device, "hidden", hidden, torch.bfloat16)
    check_tensor("router_weight", router_weight, (config.num_experts, config.hidden), torch.bfloat16, device)
    check_row_aligned("router_weight", router_weight)  # the router GEMM loads bf16 pairs as 4-byte words
    return _check_common(config, experts_per_rank, device, calibration, n, w13, w2, streaming, out, num_tokens,
                         timeline), n


def resolve_streaming(config: MoEConfig, calibration: StreamingCalibration | None, streaming: object) -> bool:
    """A call's ``streaming`` argument as the bool it means: ``"auto"`` -> what ``calibration`` decided
    (batch-ready without one); a ``ChunkringUsageError`` for anything else than True, False or "auto", or
    for True on a layer without a streaming ring. Host values only: the operator wrappers
    (:mod:`chunkring.moe.op`) call it while torch.compile traces, to hand the operator a constant bool."""
    if isinstance(streaming, str) and streaming == "auto":
        streaming = calibration is not None and calibration.streams
    if not isinstance(streaming, bool):
        raise ChunkringUsageError(f'must be True, False or "auto", got {streaming!r}', field="streaming")
    if streaming and not config.streaming:
        raise ChunkringUsageError("streaming=True needs front_num_slots and front_tokens_per_slot in the MoEConfig",
                                  field="streaming")
    return streaming


def call_chunk(config: MoEConfig, calibration: StreamingCalibration | None, mode: CallMode, n: int,
               chunk: object) -> int | None:
    """The chunk size a call of ``mode`` on ``n`` tokens publishes in: None for batch-ready (its one chunk);
    for a streamed call ``chunk`` if given (an int in [1, ``front_tokens_per_slot``]), else the size
    ``calibration`` measured fastest for ``n`` tokens, else the slot size. A ``ChunkringUsageError`` for a
    ``chunk`` out of range, whatever the mode."""
    slot = config.front_tokens_per_slot
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or (slot is not None and chunk > slot):
            raise ChunkringUsageError(f"must be an int in [1, front_tokens_per_slot={slot}], got {chunk!r}",
                                      field="chunk")
    if mode is CallMode.BATCH_READY or slot is None:
        return None
    if chunk is None:
        chunk = slot if calibration is None else min(slot, calibration.chunk_for(n))
    return chunk


def _check_batch(config: MoEConfig, device: torch.device, name: str, x: object, dtype: torch.dtype) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ChunkringUsageError("expected a 2-D tensor [n, hidden]", field=name)
    n = x.shape[0]
    if n > config.max_tokens_per_rank:
        raise ChunkringUsageError(f"{n} tokens exceed max_tokens_per_rank={config.max_tokens_per_rank}", field=name)
    check_tensor(name, x, (n, config.hidden), dtype, device)
    return n


def _check_common(config: MoEConfig, experts_per_rank: int, device: torch.device,
                  calibration: StreamingCalibration | None, n: int, w13: torch.Tensor | Fp8Weight,
                  w2: torch.Tensor | Fp8Weight, streaming: bool | str, out: torch.Tensor | None,
                  num_tokens: torch.Tensor | None, timeline: Timeline | None) -> CallMode:
    streaming = resolve_streaming(config, calibration, streaming)
    check_expert_weights(config, experts_per_rank, device, w13, w2)
    if out is not None:
        check_tensor("out", out, (n, config.hidden), torch.bfloat16, device)
    if num_tokens is not None:
        check_tensor("num_tokens", num_tokens, (1,), torch.int32, device)
    if timeline is not None:
        if not isinstance(timeline, Timeline):
            raise ChunkringUsageError(f"expected a chunkring.Timeline, got {type(timeline).__name__}", field="timeline")
        if timeline.buffer.device != device:
            raise ChunkringUsageError(f"is on {timeline.buffer.device}, the layer on {device}", field="timeline")
    return CallMode.STREAMED if streaming else CallMode.BATCH_READY
