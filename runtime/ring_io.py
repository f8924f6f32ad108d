"""Stream-ordered host API over a ring: publish torch tensors as the next chunk, and gather one
invocation's chunks from every source. Both are kernels (device/kernels/ring_host_api.cu) that go
through the same device protocol as every other producer and consumer; arguments are checked here,
before anything is enqueued.
"""

from __future__ import annotations

import torch

from .errors import ChunkringUsageError
from .ring_spec import FP8_SCALE_BLOCK, PayloadFormat

__all__ = ["publish_chunk", "gather", "GatherOutputs"]


def _library(runtime):
    from chunkring.device import Param, library_for

    desc = Param("desc", "ptr", torch.int64)
    return library_for(runtime, "ring_host_api", {
        "ring_publish_tensors": (
            desc, Param("x", "ptr", torch.uint8), Param("x_sf", "ptr", torch.float32),
            Param("topk_idx", "ptr", torch.int32), Param("topk_weights", "ptr", torch.float32),
            Param("n_tokens", "i32"), Param("token_base", "i64"), Param("end_of_stream", "i32"),
        ),
        "ring_gather": (
            desc, Param("out_x", "ptr", torch.uint8), Param("out_x_sf", "ptr", torch.float32),
            Param("out_topk_idx", "ptr", torch.int32), Param("out_topk_weights", "ptr", torch.float32),
            Param("out_counts", "ptr", torch.int64), Param("capacity", "i64"),
        ),
    })


def _x_dtype(spec):
    return torch.float8_e4m3fn if spec.payload is PayloadFormat.FP8_E4M3 else torch.bfloat16


def check_tensor(name, tensor, shape, dtype, device):
    """A typed error naming ``name`` unless ``tensor`` is a contiguous ``dtype`` tensor of ``shape`` on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise ChunkringUsageError(f"expected a torch.Tensor, got {type(tensor).__name__}", field=name)
    if tuple(tensor.shape) != tuple(shape):
        raise ChunkringUsageError(f"expected shape {tuple(shape)}, got {tuple(tensor.shape)}", field=name)
    if tensor.dtype != dtype:
        raise ChunkringUsageError(f"expected dtype {dtype}, got {tensor.dtype}", field=name)
    if tensor.device != device:
        raise ChunkringUsageError(f"tensor is on {tensor.device}, expected {device}", field=name)
    if not tensor.is_contiguous():
        raise ChunkringUsageError("tensor must be contiguous", field=name)


def publish_chunk(ring, *, x, x_sf, topk_idx, topk_weights, token_base: int, end_of_stream: bool, stream=None):
    """Publish ``x`` [n, H] (fp8 e4m3 or bf16, per the spec), ``x_sf`` [n, H/128] fp32 (FP8 only, else
    None), ``topk_idx`` [n, K] int32 (-1 = masked) and ``topk_weights`` [n, K] fp32 as this rank's next
    chunk, ordered on ``stream`` (default: current). ``n <= tokens_per_slot``; ``n == 0`` is allowed
    (an empty rank publishes one empty chunk with ``end_of_stream=True``). The call waits on the
    device, not the host, until the slot is free. ``token_base`` and ``end_of_stream`` are host values:
    fixed at capture time if this is captured in a CUDA graph.
    """
    ring._check_alive()
    spec, device = ring.spec, ring.runtime.torch_device
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ChunkringUsageError("expected a 2-D tensor [n, hidden]", field="x")
    n = x.shape[0]
    if n > spec.tokens_per_slot:
        raise ChunkringUsageError(f"{n} rows exceed tokens_per_slot={spec.tokens_per_slot}", field="x")
    check_tensor("x", x, (n, spec.hidden), _x_dtype(spec), device)
    if spec.payload.has_scales:
        check_tensor("x_sf", x_sf, (n, spec.hidden // FP8_SCALE_BLOCK), torch.float32, device)
    elif x_sf is not None:
        raise ChunkringUsageError("bf16 payloads carry no scales; pass None", field="x_sf")
    check_tensor("topk_idx", topk_idx, (n, spec.topk), torch.int32, device)
    check_tensor("topk_weights", topk_weights, (n, spec.topk), torch.float32, device)
    if isinstance(token_base, bool) or not isinstance(token_base, int) or token_base < 0:
        raise ChunkringUsageError(f"must be a non-negative int, got {token_base!r}", field="token_base")
    if not isinstance(end_of_stream, bool):
        raise ChunkringUsageError("must be a bool", field="end_of_stream")
    if n == 0 and not end_of_stream:
        raise ChunkringUsageError("an empty chunk must end the stream (only an empty rank sends one)", field="x")
    scales = x_sf if x_sf is not None else topk_weights  # never read for bf16: zero scale floats per row
    _library(ring.runtime).launch(
        "ring_publish_tensors", ring.desc, x.view(torch.uint8), scales, topk_idx, topk_weights, n, token_base,
        int(end_of_stream), block=512, stream=stream)


class GatherOutputs:
    """Dense per-source outputs of :func:`gather`: ``x`` [W, capacity, H], ``x_sf`` [W, capacity, H/128],
    ``topk_idx`` / ``topk_weights`` [W, capacity, K], ``counts`` [W] int64 (rows received per source)."""

    def __init__(self, ring, capacity: int):
        spec, device = ring.spec, ring.runtime.torch_device
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ChunkringUsageError(f"must be a non-negative int, got {capacity!r}", field="capacity")
        W = spec.world_size
        self.capacity = capacity
        self.x = torch.empty((W, capacity, spec.hidden), dtype=_x_dtype(spec), device=device)
        sf_cols = spec.hidden // FP8_SCALE_BLOCK if spec.payload.has_scales else 0
        self.x_sf = torch.empty((W, capacity, sf_cols), dtype=torch.float32, device=device)
        self.topk_idx = torch.empty((W, capacity, spec.topk), dtype=torch.int32, device=device)
        self.topk_weights = torch.empty((W, capacity, spec.topk), dtype=torch.float32, device=device)
        self.counts = torch.zeros(W, dtype=torch.int64, device=device)


def gather(ring, out: GatherOutputs, *, stream=None) -> None:
    """Consume one invocation - every chunk of every source up to its end of stream - into ``out``,
    on ``stream``. Rows land at ``[source, token_base + t]``; rows nobody sent keep their old value.
    A chunk that would not fit ``out.capacity`` is reported through the ring's status, not written.
    """
    ring._check_alive()
    if not isinstance(out, GatherOutputs):
        raise ChunkringUsageError(f"expected GatherOutputs, got {type(out).__name__}", field="out")
    _library(ring.runtime).launch(
        "ring_gather", ring.desc, out.x.view(torch.uint8), out.x_sf, out.topk_idx, out.topk_weights, out.counts,
        out.capacity, block=512, stream=stream)
