"""One MoE layer call, resolved once at the public boundary (:class:`Call`), before anything is enqueued.

:meth:`MoELayer.run` and :meth:`MoELayer.forward` check their arguments here (:func:`resolve_run`,
:func:`resolve_forward`) and get back one frozen description of the call - its mode, token count, chunk size, batch
(routed rows, or hidden states and a router), weights, outputs, timeline and the engine of its expert GEMMs - that
everything below takes: each per-call choice is made here, once. Nothing downstream checks again. The checks need no
GPU: tests drive them with CPU tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.experts import check_expert_weights
from chunkring.moe._engine.producer import PRODUCE_MAX_BLOCKS, enqueue_produce
from chunkring.moe.routing import router_logits
from chunkring.moe.timeline import Timeline
from chunkring.ring.io import check_row_aligned, check_tensor, enqueue_publish
from chunkring.ring.spec import FP8_SCALE_BLOCK, ROW_ALIGN_BYTES

if TYPE_CHECKING:
    from chunkring.jit import KernelLibrary
    from chunkring.moe.auto import StreamingCalibration
    from chunkring.moe.config import MoEConfig
    from chunkring.moe.weights import Weight
    from chunkring.ring.ring import Ring

__all__ = ["Call", "CallMode", "HiddenBatch", "RoutedBatch", "call_chunk", "resolve_forward", "resolve_mode",
           "resolve_run"]


class CallMode(enum.Enum):
    """How a call hands its batch to the consumers, and so which of the layer's rings it uses."""

    #: The whole batch as one chunk into a one-slot ring of ``max_tokens_per_rank`` rows: the full
    #: per-rank input region of today's MegaMoE contract. The default, and the correctness fallback.
    BATCH_READY = "batch_ready"
    #: Chunk by chunk into the ``stream_slots`` x ``stream_slot_tokens`` ring, each chunk as soon
    #: as its producers finish.
    STREAMED = "streamed"


@dataclass(frozen=True)
class RoutedBatch:
    """A routed batch (:meth:`MoELayer.run`): rows ``x`` [n, H] (FP8 or bf16), ``x_sf`` [n, H/128] fp32 (FP8) or
    None, ``topk_idx`` int32 [n, K], ``topk_weights`` fp32 [n, K], published as given."""

    x: torch.Tensor
    x_sf: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor

    def publish(self, ring: Ring, start: int, end: int, eos: bool, valid: torch.Tensor | None, rows: int | None,
                stream: torch.cuda.Stream, may_wait: bool) -> None:
        """Rows [start, end) as ``ring``'s next chunk, on ``stream`` (:func:`chunkring.ring.io.enqueue_publish`)."""
        enqueue_publish(ring, self.x[start:end], None if self.x_sf is None else self.x_sf[start:end],
                        self.topk_idx[start:end], self.topk_weights[start:end], start, eos, valid, rows, stream)


@dataclass(frozen=True)
class HiddenBatch:
    """Hidden states and a router (:meth:`MoELayer.forward`): ``hidden`` bf16 [n, H], ``router_weight`` bf16 [E, H];
    per chunk the router GEMM, then the fused producer (``produce``: its kernel library; ``arrivals``: its int32 [1]
    count; ``spinning_blocks``: its most blocks where it may wait for a slot) routes, quantises and publishes."""

    hidden: torch.Tensor
    router_weight: torch.Tensor
    produce: KernelLibrary
    arrivals: torch.Tensor
    spinning_blocks: int

    def publish(self, ring: Ring, start: int, end: int, eos: bool, valid: torch.Tensor | None, rows: int | None,
                stream: torch.cuda.Stream, may_wait: bool) -> None:
        """Rows [start, end) routed, quantised and published as ``ring``'s next chunk, on ``stream``."""
        chunk = self.hidden[start:end]
        logits = router_logits(chunk, self.router_weight, kernels=self.produce)  # what route() computes
        # Only a producer that may wait for a slot spins, so only its grid is sized for residency beside the other
        # ranks' spinning kernels (docs/PROTOCOL.md, "Progress" 8); the ring's first S chunks - a batch-ready call's
        # one chunk among them - keep the full grid.
        enqueue_produce(ring, self.produce, logits, chunk, start, eos, valid, rows, self.arrivals, stream,
                        self.spinning_blocks if may_wait else PRODUCE_MAX_BLOCKS)


@dataclass(frozen=True)
class Call:
    """One call of a layer at this rank, its arguments checked and every per-call choice made: ``mode``, ``batch``
    (what its producers publish), ``n`` rows, ``chunk`` (tokens per chunk of a streamed call; None: batch-ready, one
    chunk), the experts ``w13`` / ``w2``, ``out`` (None: a new tensor), ``num_tokens`` (int32 [1] on the device: the
    real rows, read when the call runs; None: all ``n``), ``timeline``, and ``decode`` (its FP8 expert GEMMs on the
    decode path rather than DeepGEMM's)."""

    mode: CallMode
    batch: RoutedBatch | HiddenBatch
    n: int
    chunk: int | None
    w13: Weight
    w2: Weight
    out: torch.Tensor | None
    num_tokens: torch.Tensor | None
    timeline: Timeline | None
    decode: bool


def resolve_mode(config: MoEConfig, calibration: StreamingCalibration | None, streaming: object) -> CallMode:
    """A call's ``streaming`` argument as its mode: ``"auto"`` -> what ``calibration`` decided (batch-ready without
    one); a ``ChunkringUsageError`` for anything else than True, False or "auto", or for True on a layer without a
    streaming ring. Host values only: the operator wrappers (:mod:`chunkring.moe.op`) call it while torch.compile
    traces, to hand the operator a constant."""
    if isinstance(streaming, str) and streaming == "auto":
        streaming = calibration is not None and calibration.streams
    if not isinstance(streaming, bool):
        raise ChunkringUsageError(f'must be True, False or "auto", got {streaming!r}', field="streaming")
    if streaming and not config.streaming:
        raise ChunkringUsageError("streaming=True needs stream_slots and stream_slot_tokens in the MoEConfig",
                                  field="streaming")
    return CallMode.STREAMED if streaming else CallMode.BATCH_READY


@dataclass(frozen=True)
class Layer:
    """What a call's checks read of its layer: ``config``, this rank's ``experts_per_rank``, its ``device``, the
    ``calibration`` ``streaming="auto"`` follows, and ``decode_for(n)``: the engine a call of ``n`` rows takes."""

    config: MoEConfig
    experts_per_rank: int
    device: torch.device
    calibration: StreamingCalibration | None
    decode_for: Callable[[int], bool]


def resolve_run(layer: Layer, mode: CallMode, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, w13: Weight, w2: Weight, *, out: torch.Tensor | None,
                num_tokens: torch.Tensor | None, timeline: Timeline | None, chunk: object) -> Call:
    """:meth:`MoELayer.run`'s call, or a ``ChunkringUsageError`` naming the first bad argument. A batch that starts
    off a 16-byte boundary is published from an aligned copy (the publish copies rows 16 bytes at a time)."""
    config, device = layer.config, layer.device
    fp8 = config.payload.has_scales
    n = _check_batch(config, device, "x", x, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    if fp8:
        check_tensor("x_sf", x_sf, (n, config.hidden // FP8_SCALE_BLOCK), torch.float32, device)
    elif x_sf is not None:
        raise ChunkringUsageError("bf16 payloads carry no scales; pass None", field="x_sf")
    check_tensor("topk_idx", topk_idx, (n, config.topk), torch.int32, device)
    check_tensor("topk_weights", topk_weights, (n, config.topk), torch.float32, device)
    _check_common(layer, n, w13, w2, out, num_tokens, timeline)
    batch = RoutedBatch(x.clone() if x.data_ptr() % ROW_ALIGN_BYTES else x, x_sf, topk_idx, topk_weights)
    return Call(mode, batch, n, call_chunk(config, layer.calibration, mode, n, chunk), w13, w2, out, num_tokens,
                timeline, layer.decode_for(n))


def resolve_forward(layer: Layer, mode: CallMode, hidden: torch.Tensor, router_weight: torch.Tensor, w13: Weight,
                    w2: Weight, *, out: torch.Tensor | None, num_tokens: torch.Tensor | None,
                    timeline: Timeline | None, chunk: object, produce: KernelLibrary, arrivals: torch.Tensor,
                    spinning_blocks: int) -> Call:
    """:meth:`MoELayer.forward`'s call, as :func:`resolve_run`; ``produce``, ``arrivals``, ``spinning_blocks``: the
    layer's fused producer, as :class:`HiddenBatch` takes them."""
    config, device = layer.config, layer.device
    n = _check_batch(config, device, "hidden", hidden, torch.bfloat16)
    check_tensor("router_weight", router_weight, (config.num_experts, config.hidden), torch.bfloat16, device)
    check_row_aligned("router_weight", router_weight)  # the router GEMM loads bf16 pairs as 4-byte words
    _check_common(layer, n, w13, w2, out, num_tokens, timeline)
    # The library's one row alignment (the fused producer itself loads 8-byte pieces of a row).
    hidden = hidden.clone() if hidden.data_ptr() % ROW_ALIGN_BYTES else hidden
    batch = HiddenBatch(hidden, router_weight, produce, arrivals, spinning_blocks)
    return Call(mode, batch, n, call_chunk(config, layer.calibration, mode, n, chunk), w13, w2, out, num_tokens,
                timeline, layer.decode_for(n))


def call_chunk(config: MoEConfig, calibration: StreamingCalibration | None, mode: CallMode, n: int,
               chunk: object) -> int | None:
    """The chunk size a call of ``mode`` on ``n`` tokens publishes in: None for batch-ready (its one chunk);
    for a streamed call ``chunk`` if given (an int in [1, ``stream_slot_tokens``]), else the size
    ``calibration`` measured fastest for ``n`` tokens, else the slot size. A ``ChunkringUsageError`` for a
    ``chunk`` out of range, whatever the mode."""
    slot = config.stream_slot_tokens
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or (slot is not None and chunk > slot):
            raise ChunkringUsageError(f"must be an int in [1, stream_slot_tokens={slot}], got {chunk!r}",
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


def _check_common(layer: Layer, n: int, w13: Weight, w2: Weight, out: torch.Tensor | None,
                  num_tokens: torch.Tensor | None, timeline: Timeline | None) -> None:
    config, device = layer.config, layer.device
    check_expert_weights(config, layer.experts_per_rank, device, w13, w2)
    if out is not None:
        check_tensor("out", out, (n, config.hidden), torch.bfloat16, device)
    if num_tokens is not None:
        check_tensor("num_tokens", num_tokens, (1,), torch.int32, device)
    if timeline is not None:
        if not isinstance(timeline, Timeline):
            raise ChunkringUsageError(f"expected a chunkring.Timeline, got {type(timeline).__name__}", field="timeline")
        if timeline.buffer.device != device:
            raise ChunkringUsageError(f"is on {timeline.buffer.device}, the layer on {device}", field="timeline")
