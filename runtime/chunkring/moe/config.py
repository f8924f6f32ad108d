"""``MoEConfig``: the shapes of one MoE layer, identical on every rank, checked when built.

A config is checked against every rule of the rings its layer allocates: building one builds the
layer's ring specs (:class:`~chunkring.ring.spec.RingSpec`) and their layouts for one rank, so a shape the
ring cannot carry (``topk`` past the experts, ``hidden`` not a multiple of the FP8 scale block, a slot
past the ring's limits) fails here, on the host, naming the config's field - not when a GPU allocates
the layer. :meth:`MoEConfig.check_world_size` adds the rules that depend on the job's rank count.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Self

from chunkring.errors import ChunkringUsageError, Problem, UsageProblems
from chunkring.ring.layout import RingLayout
from chunkring.ring.spec import FP8_SCALE_BLOCK, PayloadFormat, RingSpec
from chunkring.ring.transport import TRANSPORT_MODES

__all__ = ["DEFAULT_STREAM_SLOTS", "MAX_WAVES", "MoEConfig"]

#: Slots of the default streaming ring (MoEConfig.with_default_ring): the consumer pulls each chunk within
#: microseconds of its publish, so producers never wait for a second slot to free (docs/PERFORMANCE.md).
DEFAULT_STREAM_SLOTS = 2

#: Most waves of expert work per call (MoEConfig.waves): each wave reads every expert's weights that has
#: a block in it, so more waves than a few cost more weight traffic than they hide.
MAX_WAVES = 8


@dataclass(frozen=True)
class MoEConfig:
    """Shapes of one MoE layer, identical on every rank; checked when built, against every rule of the rings
    its layer allocates.

    Args:
        num_experts, topk: routed experts (over all ranks) and choices per token.
        hidden, intermediate: H and I: the experts' w13 is [2I, H], w2 is [H, I]. ``hidden`` is a multiple of 128
            (the producers move rows in 128-column blocks). The FP8 payload's activations carry one scale per
            1x128, so its ``intermediate`` is a multiple of 128 (the bf16 payload's, of 8: 16-byte rows for the
            grouped GEMMs).
        max_tokens_per_rank: the capacity of one call's batch per rank.
        payload: what travels between ranks: FP8 e4m3 with per-128 fp32 scales (the default), or bf16.
        stream_slots, stream_slot_tokens: the streaming ring (both or neither; neither = batch-ready only;
            :meth:`with_default_ring` picks them).
        transport: how each rank reaches its peers' slots and combine rows (:mod:`chunkring.ring.transport`):
            ``"auto"`` (loads and stores where NVSHMEM maps a peer, RMA elsewhere), ``"rma"`` (RMA for every
            peer), or None: ``CHUNKRING_TRANSPORT`` (default auto).
        waves: 1 (the default): the batch plan, expert work after every source's stream ended; 2 to
            :data:`MAX_WAVES`: incremental expert blocks (docs/PROTOCOL.md, "Incremental expert blocks"), that
            many fixed launches of expert work each computing the blocks sealed by then. Streamed calls only.

    Raises:
        ChunkringUsageError: every bad value at once, each naming its field, the value and what it must be
            (``.field``: the first).
    """

    num_experts: int
    hidden: int
    intermediate: int
    topk: int
    max_tokens_per_rank: int
    payload: PayloadFormat = PayloadFormat.FP8_E4M3
    stream_slots: int | None = None
    stream_slot_tokens: int | None = None
    transport: str | None = None
    waves: int = 1

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        # An unknown key is a usage error naming it, raised before the generated __init__ refuses it with a bare
        # TypeError (copy, pickle and dataclasses.replace pass known keys or none).
        keys = [f.name for f in fields(cls)]
        problems = UsageProblems()
        for key in sorted(set(kwargs) - set(keys)):
            problems.add("not a key of MoEConfig", field=key)
        if problems:
            problems.add(f"MoEConfig's keys: {', '.join(keys)}")
        problems.raise_if_any()
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Every bad field at once (UsageProblems), each with its value and what it must be; .field is the first.
        problems = UsageProblems()
        for name in ("num_experts", "hidden", "intermediate", "topk", "max_tokens_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.add(f"must be a positive int, got {value!r}", field=name)
        with problems.collect():
            object.__setattr__(self, "payload", PayloadFormat.checked(self.payload))
        if not problems.reported("intermediate", "payload"):
            multiple = FP8_SCALE_BLOCK if self.payload.has_scales else 8
            why = ("one activation scale per 1x128 block" if self.payload.has_scales
                   else "16-byte rows for the grouped GEMMs")
            if self.intermediate % multiple:
                problems.add(f"must be a multiple of {multiple} for the {self.payload.name} payload ({why}), got "
                             f"{self.intermediate}", field="intermediate")
        if not problems.reported("hidden", "payload") and not self.payload.has_scales and self.hidden % FP8_SCALE_BLOCK:
            # The layer's producers route, quantise and copy a row 128 columns at a time, whatever the payload; the
            # ring alone takes a bf16 row of any multiple of 8 (an FP8 row's rule is the ring's own, checked below).
            problems.add(f"must be a multiple of {FP8_SCALE_BLOCK} (the layer's producers move rows in blocks of "
                         f"{FP8_SCALE_BLOCK} columns), got {self.hidden}", field="hidden")
        self._check_stream_ring(problems)
        if self.transport is not None and self.transport not in TRANSPORT_MODES:
            problems.add(f"must be one of {TRANSPORT_MODES} or None, got {self.transport!r}", field="transport")
        if isinstance(self.waves, bool) or not isinstance(self.waves, int) or not 1 <= self.waves <= MAX_WAVES:
            problems.add(f"must be an int in [1, {MAX_WAVES}] (1: the batch plan), got {self.waves!r}", field="waves")
        # The rings' own rules (RingSpec, RingLayout) at one rank: what fails there fails at every rank count.
        # A field found at fault above keeps its own problem.
        with problems.collect():
            self.check_world_size(1)
        problems.raise_if_any()

    def _check_stream_ring(self, problems: UsageProblems) -> None:
        """The streaming ring's two fields: each a positive int or None, both or neither, a slot within the batch."""
        ring = {"stream_slots": self.stream_slots, "stream_slot_tokens": self.stream_slot_tokens}
        for name, value in ring.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.add(f"must be a positive int or None, got {value!r}", field=name)
        unset = [name for name, value in ring.items() if value is None]
        if len(unset) == 1:
            (given,) = set(ring) - set(unset)
            problems.add(f"unset while {given}={ring[given]!r} is set: set both for a streaming ring, or neither",
                         field=unset[0])
        tokens = self.stream_slot_tokens
        if (not problems.reported("stream_slot_tokens", "max_tokens_per_rank") and tokens is not None
                and tokens > self.max_tokens_per_rank):
            problems.add(f"must be at most max_tokens_per_rank={self.max_tokens_per_rank} (a chunk is part of a "
                         f"batch), got {tokens}", field="stream_slot_tokens")

    @property
    def incremental(self) -> bool:
        """Whether streamed calls compute incremental expert blocks in waves (``waves > 1``) rather than one plan."""
        return self.waves > 1

    @property
    def streaming(self) -> bool:
        """Whether the layer has a streaming ring (``streaming=True`` calls need one)."""
        return self.stream_slots is not None

    def with_default_ring(self) -> MoEConfig:
        """This config with the default streaming ring: 2 slots of ``max_tokens_per_rank / 4`` tokens (at least
        1), so the ring's payload is half the full per-rank input region. A streamed call chunks its batch in
        any size up to the slot (``chunk=``, or what calibration measured fastest), and large batches stream
        fastest in large chunks: docs/PERFORMANCE.md gives the measurements behind both numbers."""
        return replace(self, stream_slots=DEFAULT_STREAM_SLOTS,
                       stream_slot_tokens=max(1, self.max_tokens_per_rank // (2 * DEFAULT_STREAM_SLOTS)))

    def ring_spec(self, world_size: int, *, streamed: bool) -> RingSpec:
        """The spec of the streaming ring, or of the one-slot batch-ready ring. Checks the shared fields;
        an error names the config's field (``max_tokens_per_rank`` for the batch-ready ring's slot size,
        ``stream_slots`` / ``stream_slot_tokens`` for the streaming ring's)."""
        if streamed:
            slots, tokens = self.stream_slots, self.stream_slot_tokens
        else:
            slots, tokens = 1, self.max_tokens_per_rank
        if slots is None or tokens is None:
            raise ChunkringUsageError("this config has no streaming ring (set stream_slots and "
                                      "stream_slot_tokens)", field="stream_slots")
        try:
            return RingSpec(world_size=world_size, num_slots=slots, tokens_per_slot=tokens, hidden=self.hidden,
                            payload=self.payload, topk=self.topk, num_experts=self.num_experts)
        except ChunkringUsageError as exc:
            raise ChunkringUsageError.listing(_as_config_problems(exc, streamed=streamed)) from None

    def ring_specs(self, world_size: int) -> tuple[RingSpec, ...]:
        """The specs of every ring a layer of this config allocates on ``world_size`` ranks: the
        batch-ready ring, then the streaming ring if there is one."""
        return tuple(self.ring_spec(world_size, streamed=streamed)
                     for streamed in ((False, True) if self.streaming else (False,)))

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ChunkringUsageError`` unless a layer of this config can be built on ``world_size``
        ranks: every rule of its rings' specs and layouts (the experts must split evenly over the ranks,
        at most ``chunkring.ring.MAX_WORLD_SIZE`` ranks), every broken rule of both rings listed at once.
        What a launcher checks before any rank starts."""
        problems = UsageProblems()
        both = self.stream_slots is not None and self.stream_slot_tokens is not None
        for streamed in (False, True) if both else (False,):
            with problems.collect():
                RingLayout(self.ring_spec(world_size, streamed=streamed))
        problems.raise_if_any()


#: The config field behind each RingSpec field that is not one of the config's own, per ring.
_BATCH_FIELDS = {"tokens_per_slot": "max_tokens_per_rank"}
_STREAMED_FIELDS = {"tokens_per_slot": "stream_slot_tokens", "num_slots": "stream_slots"}


def _as_config_problems(exc: ChunkringUsageError, *, streamed: bool) -> list[Problem]:
    """``exc``'s problems (a RingSpec's) each naming the MoEConfig field it is about, and which ring said so."""
    out = []
    for field, message in exc.problems:
        mapped = (_STREAMED_FIELDS if streamed else _BATCH_FIELDS).get(field or "", field)
        if mapped != field:
            message = f"{message} (the {'streaming' if streamed else 'batch-ready'} ring's {field})"
        out.append((mapped, message))
    return out
