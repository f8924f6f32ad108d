"""Status records decode into messages that say who is stuck: ready-word generations with their epoch
and lap, ack words with their tag, mask and the ranks whose ack is missing."""

from chunkring.layout import STATUS
from chunkring.status import ErrorCode, Site, StatusRecord


def record(**fields):
    words = [0] * 16
    for name, value in fields.items():
        words[STATUS[name]] = int(value)
    return StatusRecord.from_words(words)


def test_no_error():
    assert record().ok and record().describe() == "no error"


def test_ack_timeout_names_the_missing_ranks():
    r = record(code=ErrorCode.TIMEOUT, site=Site.WAIT_REUSABLE, pe=0, peer=1, slot=3,
               expected=(0x00010001 << 32) | 0b1011, observed=(0x00010001 << 32) | 0b0001, count=1)
    text = r.describe()
    assert "TIMEOUT" in text and "slot 3" in text and "ack word 1" in text
    assert "no ack yet from rank(s) [33, 35]" in text


def test_stale_epoch_shows_both_epochs():
    r = record(code=ErrorCode.STALE_EPOCH, site=Site.WAIT_ROUTE, pe=2, peer=0, slot=0,
               expected=(2 << 48) | 1, observed=(1 << 48) | 1, count=1)
    text = r.describe()
    assert "PE 2: STALE_EPOCH while waiting for source 0's route of slot 0" in text
    assert "epoch 2, lap field 1" in text and "epoch 1, lap field 1" in text


def test_negative_words_from_torch_are_read_as_unsigned():
    r = record(code=ErrorCode.TIMEOUT, site=Site.WAIT_ROUTE, expected=-1)
    assert r.expected == (1 << 64) - 1


def test_unknown_codes_survive():
    assert record(code=99, site=42).code == 99
