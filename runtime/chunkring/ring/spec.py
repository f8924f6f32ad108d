"""``RingSpec``: the shape of a chunk ring, validated before anything is allocated.

Every limit here protects a protocol invariant (docs/PROTOCOL.md); an error names the field at fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chunkring.errors import ChunkringUsageError, UsageProblems

__all__ = ["PayloadFormat", "RingSpec", "MAX_WORLD_SIZE", "FP8_SCALE_BLOCK", "E4M3_MAX"]

#: A consumer tracks the sources still active in one 64-bit mask (protocol/ring.cuh consume_invocation,
#: kMaxWorldSize); each slot has one ack word per destination rank (docs/PROTOCOL.md, "Why no ABA").
MAX_WORLD_SIZE = 64
#: Channels sharing one fp32 scale in the FP8 payload.
FP8_SCALE_BLOCK = 128
#: float8_e4m3fn's largest finite value: a 1x128 block's absmax maps to it (device/include/chunkring/moe/fp8.cuh).
E4M3_MAX = 448.0
#: Rows are moved in 16-byte vectors.
ROW_ALIGN_BYTES = 16
#: Routed experts per token a slot carries (the consumer's per-token choice loop).
MAX_TOPK = 32
#: RingSpec's fields that must be ints.
_INT_FIELDS = ("world_size", "num_slots", "tokens_per_slot", "hidden", "topk", "num_experts", "epoch_bits",
               "laps_per_epoch")


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

    @property
    def hidden_multiple(self) -> tuple[int, str]:
        """What ``hidden`` (channels per token row) must be a multiple of for this payload, and why, in
        channels: whole 16-byte row vectors, and for FP8 whole scale blocks."""
        if self.has_scales:
            return FP8_SCALE_BLOCK, f"the FP8 scale block: one fp32 scale per {FP8_SCALE_BLOCK} channels"
        width = self.element_bytes
        return ROW_ALIGN_BYTES // width, f"rows move in {ROW_ALIGN_BYTES}-byte vectors of {width}-byte channels"


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
        problems = UsageProblems()  # every bad field at once, each with its value and what it must be
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                problems.add(f"must be an int, got {value!r}", field=name)
        with problems.collect():
            object.__setattr__(self, "payload", PayloadFormat.checked(self.payload))

        def check_range(name: str, low: int, high: int, why: str = "") -> bool:
            return problems.check_range(name, getattr(self, name), low, high, why)

        world_ok = check_range("world_size", 1, MAX_WORLD_SIZE, f"a consumer's source mask holds {MAX_WORLD_SIZE} "
                                                                "ranks")
        check_range("num_slots", 1, 1 << 16)
        check_range("tokens_per_slot", 1, 1 << 16)
        if check_range("hidden", 1, 1 << 16) and not problems.reported("payload"):
            multiple, why = self.payload.hidden_multiple
            if self.hidden % multiple:
                problems.add(f"must be a multiple of {multiple} ({why}), got {self.hidden}", field="hidden")
        experts_ok = check_range("num_experts", 1, 1 << 15)
        if experts_ok and world_ok and self.num_experts % self.world_size:
            problems.add(f"{self.num_experts} experts do not split evenly over {self.world_size} ranks",
                         field="num_experts")
        if experts_ok:
            top = min(self.num_experts, MAX_TOPK)
            check_range("topk", 1, top, f"at most num_experts={self.num_experts}" if top == self.num_experts
                        else f"the ring carries at most {MAX_TOPK} choices per token")
        # The seq field must hold every lap of an epoch; epoch_bits >= 16 leaves room for 65,535 resets.
        if check_range("epoch_bits", 16, 32):
            check_range("laps_per_epoch", 1, self.max_laps, f"{self.seq_bits}-bit lap field (64 - epoch_bits)")
        problems.raise_if_any()

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
