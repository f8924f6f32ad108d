"""Status records decode into messages that say who is stuck: ready-word generations with their epoch
and lap, ack words (one per destination, holding the generation it acknowledged) the same way."""

import re
import struct
from pathlib import Path

from chunkring.ring.layout import STATUS
from chunkring.ring.status import ErrorCode, InputField, InputRecord, Site, StatusRecord

REPO = Path(__file__).resolve().parents[2]


def record(**fields):
    words = [0] * 16
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
    words = [0] * 16
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
