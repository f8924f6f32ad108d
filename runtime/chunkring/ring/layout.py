"""The ring's symmetric layout, computed in one place, and the descriptor that hands it to the device.

Every rank allocates one symmetric byte buffer of ``RingLayout.total_bytes``; regions sit at identical
offsets on every rank, so the address of a word in my buffer is also its symmetric address on any peer.
The device never recomputes an offset: it reads them from the :class:`RingDesc` that
``device/include/chunkring/layout/ring_desc.cuh`` mirrors field for field (checked by a unit test and,
at run time, by ``layout_version`` and ``desc_bytes`` on the device).

Regions, in buffer order (each starts on a 128-byte line):

========================  ==============================  =============================================
region                    shape, dtype                    written by → read by
========================  ==============================  =============================================
``x``                     [S, T, H] fp8 e4m3 or bf16      owner's layout producer → every consumer
``x_sf``                  [S, T, H/128] fp32 (FP8 only)   owner's layout producer → every consumer
``topk_idx``              [S, T, K] int32, -1 = masked    owner's route producer → every consumer
``topk_weights``          [S, T, K] fp32                  owner's route producer → every consumer
``meta``                  [S, 4] int64                    owner's route producer → every consumer
``route_ready``           [W, S'] int64 (row = 128 B k)   source W's producer (remote SET) → this rank
``layout_ready``          [W, S'] int64                   source W's producer (remote SET) → this rank
``ack``                   [S, A] int64 (A = W to a line)  consumer d (remote swap, word d) → owner's producer
``consumed``              [S] int64                       owner's producer → owner (host, diagnostics)
``cursor``                [W'] int64                      this rank's consumer (next seq per source)
``control``               [16] int64                      epoch (host reset), producer's next seq
``status``                [32] int64                      first error seen by this rank's kernels, first masked input;
                                                          the abort word (any rank's first error, remote CAS) and
                                                          the abort notice (any rank's error, non-fetching set)
========================  ==============================  =============================================

``meta`` per slot: ``[token_base, num_tokens, flags, reserved]``; flags bit 0 = end of stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chunkring.errors import ChunkringUsageError
from chunkring.ring.spec import FP8_SCALE_BLOCK, PayloadFormat, RingSpec

if TYPE_CHECKING:  # the layout itself is host arithmetic; only views() touches torch
    import torch

__all__ = ["RingLayout", "Region", "DESC_FIELDS", "LAYOUT_VERSION", "CONTROL", "STATUS", "META"]

#: Bumped whenever a region or a descriptor field changes; the device refuses other versions.
LAYOUT_VERSION = 4
LINE = 128
WORD = 8

#: Index of each word of the ``control`` region.
CONTROL = {"epoch": 0, "next_seq": 1}
#: Index of each word of the ``status`` region (see device/include/chunkring/protocol/status.cuh).
STATUS = {"code": 0, "pe": 1, "peer": 2, "slot": 3, "expected": 4, "observed": 5, "site": 6, "count": 7,
          "input_field": 8, "input_source": 9, "input_slot": 10, "input_row": 11, "input_column": 12,
          "input_value": 13, "input_count": 14, "abort": 15, "abort_notice": 16}
#: Index of each word of a slot's ``meta`` row.
META = {"token_base": 0, "num_tokens": 1, "flags": 2}
META_EOS = 1

#: The descriptor's fields, all 64-bit, in order. ring_desc.cuh declares the same list.
DESC_FIELDS = (
    "layout_version", "desc_bytes", "world_size", "my_pe", "num_slots", "tokens_per_slot", "hidden",
    "topk", "num_experts", "payload_format", "epoch_bits", "timeout_ns", "base",
    "off_x", "off_x_sf", "off_topk_idx", "off_topk_weights", "off_meta", "off_route_ready",
    "off_layout_ready", "off_ack", "off_consumed", "off_cursor", "off_control", "off_status",
    "x_row_bytes", "x_sf_row_floats", "ready_row_words", "ack_slot_words", "total_bytes", "rma_peers",
    "failure_word",
)


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    shape: tuple
    dtype: str  # a torch dtype name

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPE_BYTES[self.dtype]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


_DTYPE_BYTES = {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class RingLayout:
    """Offsets and sizes of every region of a ring described by ``spec``."""

    def __init__(self, spec: RingSpec):
        if not isinstance(spec, RingSpec):
            raise ChunkringUsageError(f"expected a RingSpec, got {type(spec).__name__}", field="spec")
        self.spec = spec
        S, T, H, K, W = spec.num_slots, spec.tokens_per_slot, spec.hidden, spec.topk, spec.world_size
        fp8 = spec.payload is PayloadFormat.FP8_E4M3
        self.ready_row_words = _round_up(S, LINE // WORD)  # a source's words never share a line with another's
        self.ack_slot_words = _round_up(W, LINE // WORD)  # one word per destination; a slot's own lines
        regions = [
            ("x", (S, T, H), "float8_e4m3fn" if fp8 else "bfloat16"),
            ("x_sf", (S, T, H // FP8_SCALE_BLOCK if fp8 else 0), "float32"),
            ("topk_idx", (S, T, K), "int32"),
            ("topk_weights", (S, T, K), "float32"),
            ("meta", (S, 4), "int64"),
            ("route_ready", (W, self.ready_row_words), "int64"),
            ("layout_ready", (W, self.ready_row_words), "int64"),
            ("ack", (S, self.ack_slot_words), "int64"),
            ("consumed", (S,), "int64"),
            ("cursor", (_round_up(W, LINE // WORD),), "int64"),
            ("control", (LINE // WORD,), "int64"),
            ("status", (2 * LINE // WORD,), "int64"),
        ]
        self.regions: dict[str, Region] = {}
        offset = 0
        for name, shape, dtype in regions:
            region = Region(name, offset, shape, dtype)
            self.regions[name] = region
            offset = _round_up(region.end, LINE)
        self.total_bytes = offset  # the end of the last region, not a separate sum

    def __repr__(self) -> str:
        return f"RingLayout({self.spec}, total_bytes={self.total_bytes})"

    @property
    def payload_bytes_per_token(self) -> int:
        """Bytes one token row occupies across x, x_sf, topk_idx and topk_weights."""
        return sum(self.regions[name].nbytes for name in ("x", "x_sf", "topk_idx", "topk_weights")) // (
            self.spec.num_slots * self.spec.tokens_per_slot)

    def full_input_bytes(self, max_tokens_per_rank: int) -> int:
        """The batch-ready contract's per-rank input region (every token's x, x_sf, topk_idx and
        topk_weights at once), which the ring replaces when streaming."""
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 0:
            raise ChunkringUsageError(f"must be a non-negative int, got {max_tokens_per_rank!r}",
                                      field="max_tokens_per_rank")
        return max_tokens_per_rank * self.payload_bytes_per_token

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed torch views of every region of ``buffer`` (a uint8 tensor of ``total_bytes``)."""
        import torch

        if buffer.dtype != torch.uint8 or buffer.numel() != self.total_bytes or not buffer.is_contiguous():
            raise ChunkringUsageError(f"need a contiguous uint8 tensor of {self.total_bytes} bytes", field="buffer")
        out = {}
        for name, region in self.regions.items():
            raw = buffer[region.offset:region.end]
            out[name] = raw.view(getattr(torch, region.dtype)).view(region.shape)
        return out

    def descriptor(self, *, my_pe: int, base: int, timeout_ns: int, rma_peers: int = 0,
                   failure_word: int = 0) -> np.ndarray:
        """The device descriptor as a uint64 array in ``DESC_FIELDS`` order. ``rma_peers``: bit ``pe`` set
        when this rank reaches ``pe``'s buffers by NVSHMEM RMA (:mod:`chunkring.ring.transport`).
        ``failure_word``: the device address of the pinned host word the first recorded error is copied into
        (:mod:`chunkring.ring.failure`), 0 for none."""
        spec = self.spec
        if not 0 <= my_pe < spec.world_size:
            raise ChunkringUsageError(f"PE {my_pe} outside world of {spec.world_size}", field="my_pe")
        if isinstance(rma_peers, bool) or not isinstance(rma_peers, int) or not 0 <= rma_peers < 1 << spec.world_size:
            raise ChunkringUsageError(f"not a mask of {spec.world_size} PEs: {rma_peers!r}", field="rma_peers")
        if isinstance(failure_word, bool) or not isinstance(failure_word, int) or not 0 <= failure_word < 1 << 64:
            raise ChunkringUsageError(f"not a device address: {failure_word!r}", field="failure_word")
        values = {
            "layout_version": LAYOUT_VERSION,
            "desc_bytes": WORD * len(DESC_FIELDS),
            "world_size": spec.world_size,
            "my_pe": my_pe,
            "num_slots": spec.num_slots,
            "tokens_per_slot": spec.tokens_per_slot,
            "hidden": spec.hidden,
            "topk": spec.topk,
            "num_experts": spec.num_experts,
            "payload_format": int(spec.payload),
            "epoch_bits": spec.epoch_bits,
            "timeout_ns": timeout_ns,
            "base": base,
            **{f"off_{name}": region.offset for name, region in self.regions.items()},
            "x_row_bytes": spec.hidden * spec.payload.element_bytes,
            "x_sf_row_floats": self.regions["x_sf"].shape[2],
            "ready_row_words": self.ready_row_words,
            "ack_slot_words": self.ack_slot_words,
            "total_bytes": self.total_bytes,
            "rma_peers": rma_peers,
            "failure_word": failure_word,
        }
        assert set(values) == set(DESC_FIELDS), set(values) ^ set(DESC_FIELDS)
        return np.array([values[name] for name in DESC_FIELDS], dtype=np.uint64)
