"""Stream-ordered host API over a ring: publish torch tensors as the next chunk, and gather one
invocation's chunks from every source. Both are kernels (device/kernels/ring_host_api.cu) that go
through the same device protocol as every other producer and consumer; arguments are checked here,
before anything is enqueued.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.ring.kernel_args import RingPublishArgs
from chunkring.ring.spec import FP8_SCALE_BLOCK, ROW_ALIGN_BYTES, PayloadFormat, RingSpec
from chunkring.ring.status import AbortRecord, ErrorCode
from chunkring.runtime import TEARDOWN_WAIT_S

if TYPE_CHECKING:
    from chunkring.jit.launch import KernelArgs, KernelLibrary
    from chunkring.ring.ring import Ring
    from chunkring.runtime import Runtime

__all__ = ["GatherOutputs", "check_row_aligned", "enqueue_publish", "gather", "gather_grid_limit",
           "kernel_library", "publish_chunk", "publish_grid", "raise_abort"]

_GATHER_BLOCK = 512


def kernel_library(runtime: Runtime) -> KernelLibrary:
    """The ``ring_host_api`` kernels for ``runtime``, through which every launch of this module goes: the one
    seam where a host-only test records the launches instead (``monkeypatch.setattr(chunkring.ring.io,
    "kernel_library", ...)``)."""
    from chunkring.jit import library_for

    return library_for(runtime, "ring_host_api")


def _x_dtype(spec: RingSpec) -> torch.dtype:
    return torch.float8_e4m3fn if spec.payload is PayloadFormat.FP8_E4M3 else torch.bfloat16


def check_tensor(name: str, tensor: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """A typed error naming ``name`` unless ``tensor`` is a contiguous ``dtype`` tensor of ``shape`` on ``device``."""
    # Every call checks each of its tensors: the good case in one expression, the error's wording only after it fails.
    if (isinstance(tensor, torch.Tensor) and tensor.shape == shape and tensor.dtype is dtype and tensor.device == device
            and tensor.is_contiguous()):
        return
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


def check_row_aligned(name: str, tensor: torch.Tensor) -> None:
    """A typed error naming ``name`` unless ``tensor`` starts on a ``ROW_ALIGN_BYTES`` boundary, as the copy kernels,
    which move rows 16 bytes at a time, need (a view at an odd offset into another tensor does not: ``.clone()``
    it). Rows of H bytes from there stay aligned, since H is a multiple of 128."""
    if tensor.data_ptr() % ROW_ALIGN_BYTES:
        raise ChunkringUsageError(f"must start on a {ROW_ALIGN_BYTES}-byte boundary, got address "
                                  f"{tensor.data_ptr():#x} (a view at an odd offset: pass .clone())", field=name)


def publish_chunk(ring: Ring, *, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, token_base: int, end_of_stream: bool,
                  valid_tokens: torch.Tensor | None = None, batch_rows: int | None = None,
                  stream: torch.cuda.Stream | None = None) -> None:
    """Publish rows ``[token_base, token_base + n)`` of this rank's batch as its next chunk of ``ring``, ordered on
    ``stream``. The call waits on the device, not the host, until the slot is free.

    Args:
        ring: the ring to publish into (a collective object; publishing is this rank's alone).
        x: [n, H], float8_e4m3fn or bfloat16 as the ring's payload says; ``n <= tokens_per_slot``, and ``n == 0``
            is allowed (an empty rank publishes one empty chunk with ``end_of_stream=True``).
        x_sf: float32 [n, H/128] (FP8 payload), else None.
        topk_idx: int32 [n, K], global expert ids; -1 masks a choice.
        topk_weights: float32 [n, K].
        token_base: the chunk's first token index in the batch (a host value: fixed at graph capture).
        end_of_stream: whether this is the batch's last chunk (a host value: fixed at graph capture).
        valid_tokens: int32 [1] on the device, the batch's real token count read when the kernel runs, for a
            count that changes between graph replays; with it the chunk publishes only its rows below the
            count, ends the stream at the count (``end_of_stream`` is ignored) and publishes nothing if it lies
            wholly past it - except at ``token_base == 0``, which publishes the empty end-of-stream chunk of an
            empty rank. A count outside ``[0, batch_rows]`` is clamped and reported.
        batch_rows: the batch's capacity (required with ``valid_tokens``).
        stream: a torch stream (default: the current one).

    Raises:
        ChunkringUsageError: a tensor of another shape, dtype or device, ``x`` off a 16-byte boundary, ``n``
            past the slot, a closed ring, before anything is enqueued. Malformed values the consumers mask
            (an expert id out of range, a NaN scale, a clamped count) are reported later by ``ring.check()`` as
            ``ChunkringInputError``.
    """
    ring.check_alive()
    spec, device = ring.spec, ring.runtime.torch_device
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ChunkringUsageError("expected a 2-D tensor [n, hidden]", field="x")
    n = x.shape[0]
    if n > spec.tokens_per_slot:
        raise ChunkringUsageError(f"{n} rows exceed tokens_per_slot={spec.tokens_per_slot}", field="x")
    check_tensor("x", x, (n, spec.hidden), _x_dtype(spec), device)
    check_row_aligned("x", x)
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
    if (valid_tokens is None) != (batch_rows is None):
        raise ChunkringUsageError("pass valid_tokens and batch_rows together, or neither",
                                  field="batch_rows" if batch_rows is None else "valid_tokens")
    if valid_tokens is not None:
        check_tensor("valid_tokens", valid_tokens, (1,), torch.int32, device)
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < token_base + n:
            raise ChunkringUsageError(f"must be an int >= token_base + rows = {token_base + n}, got {batch_rows!r}",
                                      field="batch_rows")
    elif n == 0 and not end_of_stream:
        raise ChunkringUsageError("an empty chunk must end the stream (only an empty rank sends one)", field="x")
    enqueue_publish(ring, x, x_sf, topk_idx, topk_weights, token_base, end_of_stream, valid_tokens, batch_rows, stream)


PUBLISH_BYTES_PER_BLOCK = 512 * 1024
PUBLISH_MAX_BLOCKS = 64
_PUBLISH_BLOCK = 512


def publish_grid(payload_bytes: int) -> int:
    """Blocks that copy a chunk of ``payload_bytes`` into its slot: one (the one-kernel publish) up to
    :data:`PUBLISH_BYTES_PER_BLOCK`, beyond that one per that many bytes, at most :data:`PUBLISH_MAX_BLOCKS`.
    One block copies ~26 GB/s (an 8,192-token FP8 batch of hidden 4,096, 34 MB, took 1.29 ms); the three-kernel
    publish costs two more launches, a few microseconds, which a chunk below the threshold would not win back."""
    return max(1, min(-(-payload_bytes // PUBLISH_BYTES_PER_BLOCK), PUBLISH_MAX_BLOCKS))


def enqueue_publish(ring: Ring, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor,
                    topk_weights: torch.Tensor, token_base: int, end_of_stream: bool,
                    valid_tokens: torch.Tensor | None, batch_rows: int | None,
                    stream: torch.cuda.Stream | None) -> None:
    """:func:`publish_chunk` without its argument checks, for a caller that checked the whole batch once
    (the MoE layer publishes slices of a batch it validated at its public boundary)."""
    scales = x_sf if x_sf is not None else topk_weights  # never read for bf16: zero scale floats per row
    library = kernel_library(ring.runtime)
    rows, eos, rows_bound = x.shape[0], int(end_of_stream), 0 if batch_rows is None else batch_rows
    extent: KernelArgs = {"desc": ring.desc, "n_tokens": rows, "token_base": token_base, "end_of_stream": eos,
              "valid_tokens": valid_tokens, "batch_rows": rows_bound}
    tensors: KernelArgs = {"x": x.view(torch.uint8), "x_sf": scales, "topk_idx": topk_idx, "topk_weights": topk_weights}
    grid = publish_grid(x.numel() * x.element_size())
    if grid == 1:
        library.launch("ring_publish_tensors", args=RingPublishArgs(**tensors, **extent), block=_PUBLISH_BLOCK,
                       stream=stream)
        return
    library.launch("ring_publish_open", block=32, stream=stream, **extent)
    library.launch("ring_publish_copy", args=RingPublishArgs(**tensors, **extent), grid=grid, block=_PUBLISH_BLOCK,
                   stream=stream)
    library.launch("ring_publish_close", block=32, stream=stream, **extent)




class GatherOutputs:
    """Dense per-source outputs of :func:`gather`: ``x`` [W, capacity, H], ``x_sf`` [W, capacity, H/128],
    ``topk_idx`` / ``topk_weights`` [W, capacity, K], ``counts`` [W] int64 (rows received per source).

    This is a collective: every rank constructs its outputs for the same ring with the same ``capacity``
    (checked; every rank raises alike otherwise). Where any rank reaches a peer by RMA, the rows
    (``symmetric`` True) come from the NVSHMEM symmetric heap: the gather's gets land in them, and a get's
    local buffer must be NVSHMEM-registered memory for an off-node peer (docs/PROTOCOL.md, "Transports").
    Release them with :meth:`free` (or ``with``), a collective then; :meth:`chunkring.Runtime.close` frees
    what is left. Make them between calls, as a :class:`~chunkring.Ring`: a symmetric allocation waits for
    this rank's current stream and for every rank, so it must not wait behind a kernel spinning for peers.
    """

    def __init__(self, ring: Ring, capacity: int) -> None:
        spec, device, runtime = ring.spec, ring.runtime.torch_device, ring.runtime
        valid = not isinstance(capacity, bool) and isinstance(capacity, int) and capacity >= 0
        # Why symmetric memory, of the three ways to give the gets a registered destination: registering the
        # caller's torch memory (nvshmemx_buffer_register) is not in nvshmem4py 0.4.1, and it would have to be
        # undone before torch's allocator reuses the block; a symmetric bounce buffer would copy every row
        # twice. Symmetric allocations are the layer's answer for its stage too (moe/resources.py). They are
        # collectives, so the choice is the ring's, agreed by every rank: symmetric where any rank has an RMA peer.
        # A bad capacity travels in the all-gather (as None), so every rank raises here rather than one raising
        # before the collective and its peers waiting in it.
        everyone = runtime.allgather_object(capacity if valid else None)
        if not valid:
            raise ChunkringUsageError(f"must be a non-negative int, got {capacity!r}", field="capacity")
        bad = [rank for rank, c in enumerate(everyone) if c is None]
        if bad:
            raise ChunkringUsageError(f"rank(s) {bad} passed a capacity that is not a non-negative int",
                                      field="capacity")
        if any(c != capacity for c in everyone):
            raise ChunkringUsageError(f"ranks disagree (capacities {everyone})", field="capacity")
        self.symmetric: bool = ring.rma_anywhere
        self._runtime = runtime
        self._owned: list[torch.Tensor] = []

        def rows(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # A tensor of no elements stays ordinary memory: the heap holds none, and no get reaches it
            # (fetch_block skips a zero-byte fetch).
            if not self.symmetric or math.prod(shape) == 0:
                return torch.empty(shape, dtype=dtype, device=device)
            tensor = runtime.alloc(shape, dtype)
            self._owned.append(tensor)
            return tensor

        W = spec.world_size
        self.capacity = capacity
        self.x = rows((W, capacity, spec.hidden), _x_dtype(spec))
        sf_cols = spec.hidden // FP8_SCALE_BLOCK if spec.payload.has_scales else 0
        self.x_sf = rows((W, capacity, sf_cols), torch.float32)
        self.topk_idx = rows((W, capacity, spec.topk), torch.int32)
        self.topk_weights = rows((W, capacity, spec.topk), torch.float32)
        # Written by the gather's own stores, never by a get: ordinary memory.
        self.counts = torch.zeros(W, dtype=torch.int64, device=device)
        # Per (source, slot): blocks of a multi-block gather done with the current chunk.
        self.arrivals = torch.zeros((W, spec.num_slots), dtype=torch.int32, device=device)
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("symmetric" if self.symmetric else "device memory")
        return f"GatherOutputs(capacity={self.capacity}, {state})"

    def close(self) -> None:
        """Release the rows. A collective where they are ``symmetric``: :meth:`chunkring.Runtime.quiesce` first
        (this rank's gathers' gets are the only writers of these rows), bounded by
        :data:`chunkring.runtime.TEARDOWN_WAIT_S` (a missing rank raises with nothing freed, instead of hanging in
        the collective frees), then the symmetric frees. The outputs are unusable afterwards."""
        if self._closed:
            return
        if self._owned:
            self._runtime.quiesce(TEARDOWN_WAIT_S, what="GatherOutputs.close()")
            for tensor in self._owned:
                self._runtime.free(tensor)
            self._owned.clear()
        self._closed = True

    def check_alive(self) -> None:
        """Raise ``ChunkringUsageError`` if :meth:`close` ran (:func:`gather` checks this first)."""
        if self._closed:
            raise ChunkringUsageError("these GatherOutputs were closed", field="out")

    def __enter__(self) -> GatherOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gather(ring: Ring, out: GatherOutputs, *, grid: int = 1, stream: torch.cuda.Stream | None = None) -> None:
    """Consume one invocation - every chunk of every source up to its end of stream - into ``out``,
    on ``stream``. Rows land at ``[source, token_base + t]``; rows nobody sent keep their old value.
    A chunk that would not fit ``out.capacity`` is reported through the ring's status, not written.

    ``grid`` blocks consume together (each copies a share of every chunk). A grid that fills the GPU
    and is launched before the producers is the persistent consumer that starves them unless an
    :class:`chunkring.SmPartition` confines it (docs/PROTOCOL.md, "Progress"); keep it within what
    can be resident at once, or the blocks that never start stall the rest until the watchdog fires.
    """
    ring.check_alive()
    if not isinstance(out, GatherOutputs):
        raise ChunkringUsageError(f"expected GatherOutputs, got {type(out).__name__}", field="out")
    out.check_alive()
    if out.arrivals.shape[0] != ring.spec.world_size or out.arrivals.shape[1] != ring.spec.num_slots:
        raise ChunkringUsageError("these outputs were made for another ring", field="out")
    if isinstance(grid, bool) or not isinstance(grid, int) or not 1 <= grid <= 65535:
        raise ChunkringUsageError(f"must be an int in [1, 65535], got {grid!r}", field="grid")
    arrivals = None  # one block acknowledges each chunk itself: no arrival count to keep
    if grid > 1:
        arrivals = out.arrivals
        stream = stream if stream is not None else torch.cuda.current_stream(ring.runtime.torch_device)
        with torch.cuda.stream(stream):
            arrivals.zero_()  # a failed earlier gather may have left counts behind
    kernel_library(ring.runtime).launch(
        "ring_gather", desc=ring.desc, out_x=out.x.view(torch.uint8), out_x_sf=out.x_sf, out_topk_idx=out.topk_idx,
        out_topk_weights=out.topk_weights, out_counts=out.counts, capacity=out.capacity, arrivals=arrivals,
        grid=grid, block=_GATHER_BLOCK, stream=stream)


def gather_grid_limit(ring: Ring, sms: int) -> int:
    """The largest :func:`gather` grid whose blocks are all resident at once on ``sms`` SMs: the
    persistent-consumer shape that occupies those SMs completely."""
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
        raise ChunkringUsageError(f"must be a positive int, got {sms!r}", field="sms")
    return sms * kernel_library(ring.runtime).resident_blocks_per_sm("ring_gather", _GATHER_BLOCK)


def raise_abort(ring: Ring, code: ErrorCode, *, stream: torch.cuda.Stream | None = None) -> None:
    """Record ``code`` as this rank's error in ``ring`` and abort the ring at every rank, from the host: one
    one-thread kernel (``ring_raise_abort``) on ``stream`` (default: the current one), so after the work enqueued
    there before it. Peers waiting in the ring stop within microseconds with ``ChunkringPeerAbortedError`` naming
    this rank; this rank's next call raises ``ChunkringDeviceError`` (its failure word is set here, at once). Every
    rank then needs ``ring.reset()``.

    For a collective call this rank will not make while its peers may already wait in it: one whose argument
    checks failed here (``ErrorCode.HOST_USAGE``, :meth:`chunkring.MoELayer.run`)."""
    ring.check_alive()
    kernel_library(ring.runtime).launch("ring_raise_abort", desc=ring.desc, code=int(code), block=32, stream=stream)
    # The kernel's record reaches this rank's failure word only when it runs, which may come after this rank's next
    # call enters (its stream busy with the failed call's kernels): the host sets the word itself, so that call raises.
    ring.failure.set_if_clear(AbortRecord.make(ring.host_epoch, ring.runtime.rank, code).word)
