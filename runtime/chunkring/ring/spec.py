"""``RingSpec``: the shape of a chunk ring, validated before anything is allocated.

Every limit here protects a protocol invariant (docs/PROTOCOL.md); an error names the field at fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chunkring.errors import ChunkringUsageError

__all__ = ["PayloadFormat", "RingSpec", "MAX_WORLD_SIZE", "FP8_SCALE_BLOCK"]

#: A consumer tracks the sources still active in one 64-bit mask (protocol/ring.cuh consume_invocation,
#: kMaxWorldSize); each slot has one ack word per destination rank (docs/PROTOCOL.md, "Why no ABA").
MAX_WORLD_SIZE = 64
#: Channels sharing one fp32 scale in the FP8 payload.
FP8_SCALE_BLOCK = 128
#: Rows are moved in 16-byte vectors.
ROW_ALIGN_BYTES = 16


#: The short names :meth:`PayloadFormat.checked` accepts, and the members they name.
_PAYLOAD_NAMES = {"fp8": "FP8_E4M3", "bf16": "BF16"}


class PayloadFormat(enum.IntEnum):
    """How token activations sit in a slot. Values cross into device code: append only."""

    FP8_E4M3 = 0  # x: float8_e4m3fn [T, H]; x_sf: float32 [T, H / 128]
    BF16 = 1  # x: bfloat16 [T, H]; no scales

    @classmethod
    def checked(cls, value: object, *, field: str = "payload") -> PayloadFormat:
        """``value`` as a PayloadFormat: a member, its int value (not a bool or a float that merely
        compares equal to one) or its short name, ``"fp8"`` or ``"bf16"`` (config files and job keys);
        anything else is a ``ChunkringUsageError`` naming ``field``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        if isinstance(value, str) and value in _PAYLOAD_NAMES:
            return cls[_PAYLOAD_NAMES[value]]
        raise ChunkringUsageError(f"unknown payload format {value!r}; use chunkring.PayloadFormat, 'fp8' or 'bf16'",
                                  field=field)

    @property
    def element_bytes(self) -> int:
        return 1 if self is PayloadFormat.FP8_E4M3 else 2

    @property
    def has_scales(self) -> bool:
        return self is PayloadFormat.FP8_E4M3


@dataclass(frozen=True)
class RingSpec:
    """Shape of the ring every rank allocates identically.

    world_size: ranks taking part (1..64).   num_slots: slots per source rank.
    tokens_per_slot: token rows per chunk.   hidden: channels per token row.
    payload: FP8 e4m3 with fp32 per-128 scales, or bf16.
    topk: routed experts per token.          num_experts: experts in the layer (divisible by world_size).
    epoch_bits: high bits of every generation that hold the epoch; the rest count laps.
    laps_per_epoch: laps of one slot that must fit before a reset is required.
    """

    world_size: int
    num_slots: int
    tokens_per_slot: int
    hidden: int
    payload: PayloadFormat
    topk: int
    num_experts: int
    epoch_bits: int = 16
    laps_per_epoch: int = 1 << 40

    def __post_init__(self) -> None:
        for name in ("world_size", "num_slots", "tokens_per_slot", "hidden", "topk", "num_experts",
                     "epoch_bits", "laps_per_epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ChunkringUsageError(f"must be an int, got {type(value).__name__}", field=name)
        object.__setattr__(self, "payload", PayloadFormat.checked(self.payload))
        _check_range("world_size", self.world_size, 1, MAX_WORLD_SIZE,
                     f"a consumer's source mask holds {MAX_WORLD_SIZE} ranks")
        _check_range("num_slots", self.num_slots, 1, 1 << 16)
        _check_range("tokens_per_slot", self.tokens_per_slot, 1, 1 << 16)
        _check_range("hidden", self.hidden, 1, 1 << 16)
        row_bytes = self.hidden * self.payload.element_bytes
        if row_bytes % ROW_ALIGN_BYTES:
            raise ChunkringUsageError(f"a token row ({row_bytes} B) must be a multiple of {ROW_ALIGN_BYTES} B",
                                      field="hidden")
        if self.payload.has_scales and self.hidden % FP8_SCALE_BLOCK:
            raise ChunkringUsageError(f"FP8 scales cover {FP8_SCALE_BLOCK} channels; hidden must be a multiple",
                                      field="hidden")
        _check_range("num_experts", self.num_experts, 1, 1 << 15)
        if self.num_experts % self.world_size:
            raise ChunkringUsageError(f"{self.num_experts} experts do not split evenly over {self.world_size} ranks",
                                      field="num_experts")
        _check_range("topk", self.topk, 1, min(self.num_experts, 32))
        # The seq field must hold every lap of an epoch; epoch_bits >= 16 leaves room for 65,535 resets.
        _check_range("epoch_bits", self.epoch_bits, 16, 32)
        _check_range("laps_per_epoch", self.laps_per_epoch, 1, self.max_laps,
                     f"{self.seq_bits}-bit lap field (64 - epoch_bits)")

    @property
    def seq_bits(self) -> int:
        return 64 - self.epoch_bits

    @property
    def max_laps(self) -> int:
        """Laps a slot can make in one epoch: the seq field counts lap + 1 and 0 means 'never'."""
        return (1 << self.seq_bits) - 1

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size


def _check_range(field: str, value: int, low: int, high: int, why: str = "") -> None:
    if not low <= value <= high:
        suffix = f" ({why})" if why else ""
        raise ChunkringUsageError(f"must be in [{low}, {high}], got {value}{suffix}", field=field)
