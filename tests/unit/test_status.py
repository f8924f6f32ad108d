"""Status records decode into messages that say who is stuck: ready-word generations with their epoch
and lap, ack words (one per destination, holding the generation it acknowledged) the same way; the abort
word names the rank that failed first, and check()'s exception says whether this rank or a peer failed."""

import re
import struct
from pathlib import Path

import pytest

from chunkring.errors import (
    ChunkringDeviceError,
    ChunkringInputError,
    ChunkringPeerAbortedError,
    ChunkringRuntimeError,
    ChunkringTimeoutError,
    ChunkringUsageError,
)
from chunkring.ring.layout import STATUS
from chunkring.ring.ring import check_epochs_agree
from chunkring.ring.status import (
    ABORT_CODE_BITS,
    ABORT_ORIGIN_BITS,
    AbortRecord,
    ErrorCode,
    InputField,
    InputRecord,
    Site,
    StatusRecord,
    status_error,
)

REPO = Path(__file__).resolve().parents[2]
#: Words of the status region (two lines of int64).
STATUS_WORDS = 32


def record(**fields):
    words = [0] * STATUS_WORDS
    for name, value in fields.items():
        words[STATUS[name]] = int(value)
    return StatusRecord.from_words(words)


def test_no_error():
    assert record().ok and record().describe() == "no error"


def test_ack_timeout_names_the_missing_rank():
    r = record(code=ErrorCode.TIMEOUT, site=Site.WAIT_REUSABLE, pe=0, peer=33, slot=3,
               expected=(1 << 48) | 2, observed=(1 << 48) | 1, count=1)
    text = r.describe()
    assert "PE 0: TIMEOUT while waiting for rank 33's ack of slot 3" in text
    assert "expected 0x1000000000002 (epoch 1, lap field 2)" in text and "(epoch 1, lap field 1)" in text


def test_stale_epoch_shows_both_epochs():
    r = record(code=ErrorCode.STALE_EPOCH, site=Site.WAIT_ROUTE, pe=2, peer=0, slot=0,
               expected=(2 << 48) | 1, observed=(1 << 48) | 1, count=1)
    text = r.describe()
    assert "PE 2: STALE_EPOCH while waiting for source 0's route of slot 0" in text
    assert "epoch 2, lap field 1" in text and "epoch 1, lap field 1" in text


def test_push_wait_timeout_shows_block_counts_not_generations():
    r = record(code=ErrorCode.TIMEOUT, site=Site.WAIT_PUSHED, pe=1, peer=1, expected=264, observed=263, count=1)
    text = r.describe()
    assert "PE 1: TIMEOUT while waiting for this rank's combine push before its held acks" in text
    assert "expected 264 blocks, observed 263" in text and "epoch" not in text


def test_negative_words_from_torch_are_read_as_unsigned():
    r = record(code=ErrorCode.TIMEOUT, site=Site.WAIT_ROUTE, expected=-1)
    assert r.expected == (1 << 64) - 1


def test_unknown_codes_survive():
    assert record(code=99, site=42).code == 99


def input_record(**fields):
    words = [0] * STATUS_WORDS
    for name, value in fields.items():
        words[STATUS[f"input_{name}"]] = int(value)
    return InputRecord.from_words(words, pe=3)


def test_masked_inputs_say_what_where_and_how():
    assert input_record().ok
    r = input_record(field=InputField.TOPK_IDX, source=1, slot=2, row=5, column=7, value=-9, count=4)
    assert r.shown_value() == -9
    assert r.describe() == ("PE 3: malformed TOPK_IDX in source 1's slot 2 row 5 column 7: -9 "
                            "(masked as -1; 4 value(s) masked in all)")
    nan_bits = struct.unpack("<I", struct.pack("<f", float("inf")))[0]
    assert "X_SF" in input_record(field=InputField.X_SF, value=nan_bits, count=1).describe()
    assert input_record(field=InputField.X_SF, value=nan_bits, count=1).shown_value() == float("inf")
    clamped = input_record(field=InputField.VALID_TOKENS, value=99, count=1).describe()
    assert "rank 0's num_tokens: 99 (clamped" in clamped


def test_enums_mirror_the_cuda_headers():
    headers = REPO / "device" / "include" / "chunkring" / "protocol"
    for enum_type, header in ((ErrorCode, "status.cuh"), (Site, "status.cuh"), (InputField, "validate.cuh")):
        text = (headers / header).read_text()
        for member in enum_type:
            camel = "".join(part.capitalize() for part in member.name.split("_"))
            assert re.search(rf"\bk{camel} = {member.value}\b", text), (enum_type.__name__, member.name)


# ---------------------------------------------------------------- the abort word and check()'s verdict

def words(**fields):
    out = [0] * STATUS_WORDS
    for name, value in fields.items():
        out[STATUS[name]] = int(value)
    return out


def test_abort_word_round_trips_every_field():
    for epoch, origin, code in ((1, 0, ErrorCode.TIMEOUT), ((1 << 32) - 1, 63, ErrorCode.PEER_ABORTED),
                                (7, 5, ErrorCode.STALE_EPOCH)):
        a = AbortRecord.make(epoch, origin, code)
        assert a.raised and (a.epoch, a.origin, a.code) == (epoch, origin, code)
        assert AbortRecord.from_word(a.word - (1 << 64) if a.word >> 63 else a.word) == a  # torch's signed view
    assert not AbortRecord.from_word(0).raised
    for epoch, origin in ((1, 256), (1 << 48, 0)):
        with pytest.raises(ChunkringUsageError):
            AbortRecord.make(epoch, origin, ErrorCode.TIMEOUT)
    with pytest.raises(ChunkringUsageError):
        AbortRecord.make(1, 0, ErrorCode.NONE)  # a raised word is never 0


def test_abort_word_layout_mirrors_the_cuda_header():
    text = (REPO / "device/include/chunkring/protocol/status.cuh").read_text()
    assert f"kAbortCodeBits = {ABORT_CODE_BITS}, kAbortOriginBits = {ABORT_ORIGIN_BITS};" in text
    # the header's static_assert: kPeerAborted fits the code field
    assert f"abort_code(make_abort(1, 0, ErrorCode::kPeerAborted)) == {int(ErrorCode.PEER_ABORTED)}" in text
    assert AbortRecord.make(1, 0, ErrorCode.PEER_ABORTED).code == ErrorCode.PEER_ABORTED


def test_nothing_recorded_raises_nothing():
    assert status_error(words(), rank=0) is None


def test_a_peer_abort_names_the_failed_rank_even_when_no_wait_saw_it():
    abort = AbortRecord.make(3, 2, ErrorCode.STALE_EPOCH)
    error = status_error(words(abort=abort.word), rank=0)
    assert isinstance(error, ChunkringPeerAbortedError)
    assert (error.origin_rank, error.code, error.epoch) == (2, ErrorCode.STALE_EPOCH, 3)
    assert "rank 2 recorded STALE_EPOCH (epoch 3)" in str(error) and "did not fail itself" in str(error)


def test_a_wait_stopped_by_a_peer_abort_says_where_it_waited_and_who_failed():
    abort = AbortRecord.make(1, 3, ErrorCode.TIMEOUT)
    w = words(code=ErrorCode.PEER_ABORTED, site=Site.WAIT_ROUTE, pe=1, peer=0, slot=2, expected=(1 << 48) | 1,
              observed=abort.word, count=1, abort=abort.word)
    record = StatusRecord.from_words(w)
    assert record.cause == ErrorCode.TIMEOUT
    error = status_error(w, rank=1)
    assert isinstance(error, ChunkringPeerAbortedError) and error.origin_rank == 3 and error.code == ErrorCode.TIMEOUT
    assert str(error).startswith("PE 1: PEER_ABORTED while waiting for source 0's route of slot 2: "
                                 "rank 3 recorded TIMEOUT (epoch 1)")


def test_this_ranks_own_error_is_not_a_peer_abort():
    own = AbortRecord.make(1, 1, ErrorCode.TIMEOUT)
    w = words(code=ErrorCode.TIMEOUT, site=Site.WAIT_REUSABLE, pe=1, peer=0, count=1, abort=own.word)
    error = status_error(w, rank=1)
    assert type(error) is ChunkringTimeoutError and error.record.code == ErrorCode.TIMEOUT
    assert "reached this rank first" not in str(error)
    other = AbortRecord.make(1, 0, ErrorCode.DOUBLE_ACK)  # two ranks failed; rank 0's abort landed here first
    error = status_error(words(code=ErrorCode.STALE_EPOCH, pe=1, count=1, abort=other.word), rank=1)
    assert type(error) is ChunkringDeviceError and error.record.code == ErrorCode.STALE_EPOCH
    assert ("rank 0's abort (rank 0 recorded DOUBLE_ACK (epoch 1) and aborted the ring) reached this rank first"
            in str(error))


def test_a_masked_input_alone_is_an_input_error_and_ranks_below_errors():
    masked = dict(input_field=InputField.TOPK_IDX, input_count=1)
    assert isinstance(status_error(words(**masked), rank=0), ChunkringInputError)
    error = status_error(words(abort=AbortRecord.make(1, 1, ErrorCode.TIMEOUT).word, **masked), rank=0)
    assert isinstance(error, ChunkringPeerAbortedError) and "also PE 0: malformed TOPK_IDX" in str(error)


def test_ranks_must_agree_on_the_epoch_before_a_reset():
    check_epochs_agree([4, 4, 4])
    check_epochs_agree([1])
    with pytest.raises(ChunkringRuntimeError, match=r"rank 0: 4, rank 1: 3, rank 2: 4"):
        check_epochs_agree([4, 3, 4])
