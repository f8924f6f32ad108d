"""Decode the status record protocol kernels leave in a ring (device/include/chunkring/protocol/status.cuh),
and map it to the exception ``Ring.check`` raises (:func:`status_error`)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from chunkring.errors import (
    ChunkringDeviceError,
    ChunkringInputError,
    ChunkringPeerAbortedError,
    ChunkringTimeoutError,
    ChunkringUsageError,
)
from chunkring.ring.layout import CONTROL, STATUS

__all__ = ["AbortRecord", "ErrorCode", "InputField", "InputRecord", "Site", "StatusRecord", "describe_words",
           "failure_error", "status_error"]


class ErrorCode(enum.IntEnum):
    """Mirrors protocol/status.cuh ErrorCode (append-only)."""

    NONE = 0
    TIMEOUT = 1
    STALE_EPOCH = 2
    GENERATION_AHEAD = 3
    ACK_TAG_MISMATCH = 4
    BAD_DESCRIPTOR = 5
    LAP_OVERFLOW = 6
    PAYLOAD_MISMATCH = 7
    PEER_UNREACHABLE = 8
    DOUBLE_ACK = 9
    BAD_METADATA = 10  # retired: malformed metadata is masked and reported as an InputRecord
    PEER_ABORTED = 11  # a wait stopped because a rank of the ring recorded an error (the abort word names it)
    INTERNAL = 12  # an invariant of this rank's own kernels failed (incremental expert blocks, a MoE descriptor)
    HOST_USAGE = 13  # this rank refused a collective call at its entry (a bad argument, an earlier error): raise_abort


class InputField(enum.IntEnum):
    """Mirrors protocol/validate.cuh InputField (append-only): what a consumer masked, and how."""

    NONE = 0
    TOPK_IDX = 1  # outside [-1, num_experts): the choice is masked (-1)
    X_SF = 2  # NaN or infinite: the scale is read as 0
    NUM_TOKENS = 3  # above tokens_per_slot: the chunk is read as empty
    TOKEN_BASE = 4  # base + count beyond the consumer's output: the chunk is read as empty
    VALID_TOKENS = 5  # the device token count outside [0, batch rows]: clamped


_MASKED_AS: dict[int, str] = {
    InputField.TOPK_IDX: "masked as -1",
    InputField.X_SF: "read as 0",
    InputField.NUM_TOKENS: "chunk read as empty",
    InputField.TOKEN_BASE: "chunk read as empty",
    InputField.VALID_TOKENS: "clamped",
}


class Site(enum.IntEnum):
    """Mirrors protocol/status.cuh Site (append-only)."""

    NONE = 0
    WAIT_ROUTE = 1
    WAIT_LAYOUT = 2
    WAIT_REUSABLE = 3
    ACK = 4
    PAYLOAD = 5
    DESCRIPTOR = 6
    PUBLISH = 7
    WAIT_PUSHED = 8
    WAIT_BLOCKS = 9
    WAIT_ALLOCATION = 10
    BLOCKS = 11
    HOST_CHECK = 12


_WHAT: dict[int, str] = {
    Site.WAIT_ROUTE: "waiting for source {peer}'s route of slot {slot}",
    Site.WAIT_LAYOUT: "waiting for source {peer}'s layout of slot {slot}",
    Site.WAIT_REUSABLE: "waiting for rank {peer}'s ack of slot {slot}",
    Site.ACK: "acknowledging source {peer}'s slot {slot}",
    Site.PAYLOAD: "checking source {peer}'s slot {slot}",
    Site.DESCRIPTOR: "checking a descriptor (the ring's, or a MoE stage or pool one: then slot {slot} names the "
                     "field, moe/descriptors.cuh DescField)",
    Site.PUBLISH: "publishing slot {slot}",
    Site.WAIT_PUSHED: "waiting for this rank's combine push before its held acks",
    Site.WAIT_BLOCKS: "a wave's claim waiting for sealed expert blocks",
    Site.WAIT_ALLOCATION: "a pull lane waiting for the allocation of expert {slot}'s block",
    Site.BLOCKS: "checking incremental expert block {slot}",
    Site.HOST_CHECK: "checking a collective call's arguments on the host (ChunkringUsageError raised there)",
}


@dataclass(frozen=True)
class StatusRecord:
    """The first error a rank's kernels recorded (``code == NONE`` when there was none). A code or site
    this decoder does not know stays a plain int."""

    code: ErrorCode | int
    pe: int
    peer: int
    slot: int
    expected: int
    observed: int
    site: Site | int
    count: int

    @classmethod
    def from_words(cls, words: Iterable[int]) -> StatusRecord:
        w = _unsigned(words)
        return cls(
            code=_enum_or_int(ErrorCode, w[STATUS["code"]]),
            pe=w[STATUS["pe"]],
            peer=w[STATUS["peer"]],
            slot=w[STATUS["slot"]],
            expected=w[STATUS["expected"]],
            observed=w[STATUS["observed"]],
            site=_enum_or_int(Site, w[STATUS["site"]]),
            count=w[STATUS["count"]],
        )

    @property
    def ok(self) -> bool:
        return self.code == ErrorCode.NONE

    @property
    def cause(self) -> ErrorCode | int:
        """The error that started it: this record's own code, or for ``PEER_ABORTED`` the code the failed
        rank recorded (the abort word in ``observed``)."""
        return AbortRecord.from_word(self.observed).code if self.code == ErrorCode.PEER_ABORTED else self.code

    def describe(self, epoch_bits: int = 16) -> str:
        if self.ok:
            return "no error"
        where = _WHAT.get(self.site, "at site {site}").format(peer=self.peer, slot=self.slot, site=self.site)
        code = self.code.name if isinstance(self.code, ErrorCode) else self.code
        if self.code == ErrorCode.PEER_ABORTED:  # `observed` holds the abort word that stopped the wait
            return f"PE {self.pe}: {code} while {where}: {AbortRecord.from_word(self.observed).describe()}"
        # every word a protocol error names holds a generation - ack words too (one per destination):
        # at WAIT_REUSABLE the one the owner waits for, at ACK the one the consumer's swap should replace
        values = f"expected {_gen(self.expected, epoch_bits)}, observed {_gen(self.observed, epoch_bits)}"
        if self.site == Site.WAIT_PUSHED:  # the one wait on a count: of combine-push blocks arrived
            values = f"expected {self.expected} blocks, observed {self.observed}"
        if self.site == Site.HOST_CHECK:  # recorded for the host: no wait, no value
            values = "the peers waiting in that call were aborted; reset() to continue"
        return f"PE {self.pe}: {code} while {where}: {values} ({self.count} error(s) recorded)"


@dataclass(frozen=True)
class InputRecord:
    """The first malformed value this rank's consumers masked (``count`` of them in all; 0 = none). A
    field this decoder does not know stays a plain int."""

    field: InputField | int
    pe: int
    source: int
    slot: int
    row: int
    column: int
    value: int  # raw 64-bit word: a sign-extended int, or a float's bits
    count: int

    @classmethod
    def from_words(cls, words: Iterable[int], pe: int) -> InputRecord:
        w = _unsigned(words)
        return cls(field=_enum_or_int(InputField, w[STATUS["input_field"]]), pe=pe, source=w[STATUS["input_source"]],
                   slot=w[STATUS["input_slot"]], row=w[STATUS["input_row"]], column=w[STATUS["input_column"]],
                   value=w[STATUS["input_value"]], count=w[STATUS["input_count"]])

    @property
    def ok(self) -> bool:
        return self.count == 0

    def shown_value(self) -> int | float:
        if self.field == InputField.X_SF:
            import struct

            return struct.unpack("<f", struct.pack("<I", self.value & 0xFFFFFFFF))[0]
        return self.value - (1 << 64) if self.value >> 63 else self.value

    def describe(self) -> str:
        if self.ok:
            return "no malformed input"
        name = self.field.name if isinstance(self.field, InputField) else self.field
        where = (f"source {self.source}'s slot {self.slot}" if self.field != InputField.VALID_TOKENS
                 else f"rank {self.source}'s num_tokens")
        cell = f" row {self.row} column {self.column}" if self.field in (InputField.TOPK_IDX, InputField.X_SF) else ""
        return (f"PE {self.pe}: malformed {name} in {where}{cell}: {self.shown_value()!r} "
                f"({_MASKED_AS.get(self.field, 'masked')}; {self.count} value(s) masked in all)")


#: Field widths of the abort word (protocol/status.cuh kAbortCodeBits, kAbortOriginBits).
ABORT_CODE_BITS = 8
ABORT_ORIGIN_BITS = 8


@dataclass(frozen=True)
class AbortRecord:
    """The abort word of a ring at one rank: the first error of a rank of the ring that this rank learned of in the
    epoch - its own, or the first peer's notice one of its kernels read (``word == 0``: none). Layout, as
    protocol/status.cuh ``make_abort``: [63:16] epoch, [15:8] origin rank, [7:0] error code."""

    word: int

    @classmethod
    def from_word(cls, word: int) -> AbortRecord:
        return cls(int(word) & ((1 << 64) - 1))

    @classmethod
    def make(cls, epoch: int, origin: int, code: ErrorCode | int) -> AbortRecord:
        """The word rank ``origin`` raises for ``code`` in ``epoch`` (the device's ``make_abort``)."""
        fits = (0 <= epoch < 1 << (64 - ABORT_CODE_BITS - ABORT_ORIGIN_BITS) and 0 <= origin < 1 << ABORT_ORIGIN_BITS
                and 0 < int(code) < 1 << ABORT_CODE_BITS)
        if not fits:
            raise ChunkringUsageError(f"epoch {epoch}, origin {origin} or code {code} does not fit the abort word",
                                      field="abort")
        return cls(int(epoch) << (ABORT_CODE_BITS + ABORT_ORIGIN_BITS) | origin << ABORT_CODE_BITS | int(code))

    @property
    def raised(self) -> bool:
        return self.word != 0

    @property
    def origin(self) -> int:
        return self.word >> ABORT_CODE_BITS & ((1 << ABORT_ORIGIN_BITS) - 1)

    @property
    def code(self) -> ErrorCode | int:
        return _enum_or_int(ErrorCode, self.word & ((1 << ABORT_CODE_BITS) - 1))

    @property
    def epoch(self) -> int:
        return self.word >> (ABORT_CODE_BITS + ABORT_ORIGIN_BITS)

    def describe(self) -> str:
        if not self.raised:
            return "no rank aborted"
        code = self.code.name if isinstance(self.code, ErrorCode) else self.code
        return f"rank {self.origin} recorded {code} (epoch {self.epoch}) and aborted the ring"


def status_error(words: Iterable[int], *, rank: int, epoch_bits: int = 16) -> ChunkringDeviceError | None:
    """The error ``Ring.check`` raises for one rank's status words, or ``None``. In order: this rank's own
    error - ``ChunkringTimeoutError`` for a watchdog, ``ChunkringDeviceError`` otherwise; then a peer's
    abort - ``ChunkringPeerAbortedError`` naming the rank that failed, whether or not a wait of this rank
    saw it; then the first masked input - ``ChunkringInputError``."""
    w = _unsigned(words)
    record, masked = StatusRecord.from_words(w), InputRecord.from_words(w, rank)
    # The abort word holds the first abort this rank's kernels saw; the notice (the latest to land) stands in where
    # none of them looked (status.cuh abort_word).
    abort = AbortRecord.from_word(w[STATUS["abort"]] or w[STATUS["abort_notice"]])
    also = f"; also {masked.describe()}" if not masked.ok else ""
    if not record.ok and record.code != ErrorCode.PEER_ABORTED:  # this rank failed
        if abort.raised and abort.origin != rank:
            also += f"; rank {abort.origin}'s abort ({abort.describe()}) reached this rank first"
        kind = ChunkringTimeoutError if record.code == ErrorCode.TIMEOUT else ChunkringDeviceError
        return kind(record.describe(epoch_bits) + also, record)
    if record.code == ErrorCode.PEER_ABORTED or abort.raised:  # a peer failed
        seen = AbortRecord.from_word(record.observed) if record.code == ErrorCode.PEER_ABORTED else abort
        stopped = record.describe(epoch_bits) if not record.ok else f"PE {rank}: {seen.describe()}"
        return ChunkringPeerAbortedError(f"{stopped}; this rank did not fail itself (see rank {seen.origin}'s "
                                         f"report; reset() to continue){also}", seen, origin_rank=seen.origin,
                                         code=seen.code, epoch=seen.epoch)
    if not masked.ok:
        return ChunkringInputError(masked.describe(), masked)
    return None


def failure_error(word: int, *, rank: int) -> ChunkringDeviceError:
    """The error a rank's failure word stands for (the pinned host word its kernels copy their first recorded
    error into, :mod:`chunkring.ring.failure`: an abort word naming the origin rank, code and epoch), without the
    status record: for where the record cannot be read (a stream being captured cannot synchronise). Its
    origin is this rank: ``ChunkringTimeoutError`` for a watchdog, else ``ChunkringDeviceError``; another
    rank: ``ChunkringPeerAbortedError`` naming it."""
    seen = AbortRecord.from_word(word)
    if not seen.raised:
        raise ChunkringUsageError("the failure word is 0: no error was recorded", field="word")
    details = "check() outside a graph capture reads the whole record; reset() to continue"
    if seen.origin != rank:
        return ChunkringPeerAbortedError(f"PE {rank}: {seen.describe()}; this rank did not fail itself ({details})",
                                         seen, origin_rank=seen.origin, code=seen.code, epoch=seen.epoch)
    code = seen.code.name if isinstance(seen.code, ErrorCode) else seen.code
    kind = ChunkringTimeoutError if seen.code == ErrorCode.TIMEOUT else ChunkringDeviceError
    return kind(f"PE {rank}: {code} recorded by this rank's kernels (epoch {seen.epoch}; {details})", seen)


def describe_words(words: dict[str, list], *, num_slots: int, world_size: int, epoch_bits: int = 16,
                   abort: AbortRecord | None = None) -> str:
    """One rank's protocol words as text, for a failure's diagnostic (``Ring.protocol_words``): its producer's
    next chunk, its consumer's next chunk per source, the ready words it holds per source and slot, and the
    ack words of its own slots per destination. ``words``: the ring's ``control``, ``cursor``,
    ``route_ready``, ``layout_ready`` and ``ack`` regions as lists. A generation reads ``e<epoch>:<seq>``, the
    chunk it stands for; ``-`` is a word never written in the epoch. ``abort``: the rank's abort word; when
    raised, a last line says the words may have moved since the failed wait (below)."""
    S, W, seq_bits = num_slots, world_size, 64 - epoch_bits

    def chunk(value: int, slot: int) -> str:
        gen = value & ((1 << 64) - 1)
        if gen == 0:
            return "-"
        return f"e{gen >> seq_bits}:{((gen & ((1 << seq_bits) - 1)) - 1) * S + slot}"

    control = words["control"]
    lines = [f"producer: next chunk {control[CONTROL['next_seq']]} (epoch {control[CONTROL['epoch']]}); "
             f"consumer: next chunk per source {[int(c) for c in words['cursor'][:W]]}"]
    for name in ("route_ready", "layout_ready"):
        rows = (" ".join(chunk(words[name][src][slot], slot) for slot in range(S)) for src in range(W))
        lines.append(f"{name} by source, slots 0..{S - 1}: " + "; ".join(f"{src}: {r}" for src, r in enumerate(rows)))
    acks = (" ".join(chunk(words["ack"][slot][dest], slot) for dest in range(W)) for slot in range(S))
    lines.append(f"acks by slot, destinations 0..{W - 1}: " + "; ".join(f"{slot}: {a}" for slot, a in enumerate(acks)))
    if abort is not None and abort.raised:
        # The abort ends every spin, freeing the SMs its blocks held: a kernel that could not start beside them
        # (docs/PROTOCOL.md, Progress 8) may then publish, and consumers not yet polling the abort take it.
        lines.append(f"read after the abort ({abort.describe()}): kernels stalled before it may have run since, so "
                     "positions and words can be past where the failed wait found them")
    return "\n".join(lines)


def _unsigned(words: Iterable[int]) -> list[int]:
    """Status words as the device wrote them: torch reads the int64 region as signed."""
    return [int(v) & ((1 << 64) - 1) for v in words]


_Enum = TypeVar("_Enum", bound=enum.IntEnum)


def _enum_or_int(kind: type[_Enum], value: int) -> _Enum | int:
    try:
        return kind(value)
    except ValueError:
        return value


def _gen(value: int, epoch_bits: int) -> str:
    seq_bits = 64 - epoch_bits
    return f"0x{value:x} (epoch {value >> seq_bits}, lap field {value & ((1 << seq_bits) - 1)})"

