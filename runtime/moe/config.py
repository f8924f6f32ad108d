"""``MoEConfig``: the shapes of one MoE layer, identical on every rank, checked when built."""

from __future__ import annotations

from dataclasses import dataclass, replace

from chunkring.errors import ChunkringUsageError
from chunkring.ring.spec import PayloadFormat, RingSpec

__all__ = ["DEFAULT_FRONT_NUM_SLOTS", "MoEConfig"]

#: Slots of the default streaming ring (MoEConfig.with_default_ring): the consumer pulls each chunk within
#: microseconds of its publish, so producers never wait for a second slot to free (docs/PERFORMANCE.md).
DEFAULT_FRONT_NUM_SLOTS = 2


@dataclass(frozen=True)
class MoEConfig:
    """Shapes of one MoE layer, identical on every rank.

    num_experts, topk: routed experts and choices per token.  hidden, intermediate: H and I (the
    experts' w13 is [2I, H], w2 is [H, I]).  max_tokens_per_rank: capacity of one call's batch per rank.
    payload: what travels between ranks (FP8 e4m3 with per-128 fp32 scales, or bf16).
    front_num_slots, front_tokens_per_slot: the streaming ring (both or neither; neither = batch-ready only).
    block_m: rows each expert group is padded to (the grouped GEMM's row block).
    """

    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    max_tokens_per_rank: int
    payload: PayloadFormat = PayloadFormat.FP8_E4M3
    front_num_slots: int | None = None
    front_tokens_per_slot: int | None = None
    block_m: int = 16

    def __post_init__(self):
        for name in ("num_experts", "hidden", "intermediate", "topk", "max_tokens_per_rank", "block_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ChunkringUsageError(f"must be a positive int, got {value!r}", field=name)
        object.__setattr__(self, "payload", PayloadFormat.checked(self.payload))
        if self.intermediate % 8:  # grouped GEMM operands need 16-byte rows
            raise ChunkringUsageError(f"must be a multiple of 8, got {self.intermediate}", field="intermediate")
        if (self.front_num_slots is None) != (self.front_tokens_per_slot is None):
            raise ChunkringUsageError("set both front_num_slots and front_tokens_per_slot, or neither",
                                      field="front_num_slots" if self.front_num_slots is None else "front_tokens_per_slot")
        for name in ("front_num_slots", "front_tokens_per_slot"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ChunkringUsageError(f"must be a positive int or None, got {value!r}", field=name)
        if self.front_tokens_per_slot is not None and self.front_tokens_per_slot > self.max_tokens_per_rank:
            raise ChunkringUsageError(f"{self.front_tokens_per_slot} exceeds max_tokens_per_rank="
                                      f"{self.max_tokens_per_rank}", field="front_tokens_per_slot")

    @property
    def streaming(self) -> bool:
        """Whether the layer has a streaming ring (``streaming=True`` calls need one)."""
        return self.front_num_slots is not None

    def with_default_ring(self) -> "MoEConfig":
        """This config with the default streaming ring: 2 slots of ``max_tokens_per_rank / 16`` tokens
        (at least 1), so the ring's payload is 1/8 of the full per-rank input region. docs/PERFORMANCE.md
        gives the measurements behind both numbers."""
        return replace(self, front_num_slots=DEFAULT_FRONT_NUM_SLOTS,
                       front_tokens_per_slot=max(1, self.max_tokens_per_rank // (8 * DEFAULT_FRONT_NUM_SLOTS)))

    def ring_spec(self, world_size: int, *, streamed: bool) -> RingSpec:
        """The spec of the streaming ring, or of the one-slot batch-ready ring. Checks the shared fields."""
        slots, tokens = (self.front_num_slots, self.front_tokens_per_slot) if streamed else (1, self.max_tokens_per_rank)
        return RingSpec(world_size=world_size, num_slots=slots, tokens_per_slot=tokens, hidden=self.hidden,
                        payload=self.payload, topk=self.topk, num_experts=self.num_experts)
