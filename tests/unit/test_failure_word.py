"""The host's side of failing closed, on the CPU: the failure word (chunkring.ring.failure) reads back what the device
stores, as the unsigned abort word it is; ``raise_recorded_failure`` synchronises and raises the ring's own
``check()`` error only when the word is set, and falls back on what the word alone names (inside a graph capture,
where nothing may synchronise, or when the record says nothing); ``failure_error`` names this rank's own error or
the origin of a peer's abort; the abort notice (the word every failing rank sends without waiting, before its
compare-and-swaps) stands in for an abort word that never landed, and a ``HOST_USAGE`` record says what happened."""

from __future__ import annotations

import pytest
import torch

import chunkring.ring.failure
from chunkring.errors import (
    ChunkringDeviceError,
    ChunkringPeerAbortedError,
    ChunkringRuntimeError,
    ChunkringTimeoutError,
    ChunkringUsageError,
)
from chunkring.ring.failure import FailureWord, raise_recorded_failure
from chunkring.ring.layout import STATUS
from chunkring.ring.status import AbortRecord, ErrorCode, Site, failure_error, status_error

STATUS_WORDS = 32


def test_the_word_reads_back_unsigned_and_clears():
    word = FailureWord(torch.zeros(1, dtype=torch.int64))
    assert word.read() == 0
    abort = AbortRecord.make((1 << 48) - 1, 63, ErrorCode.TIMEOUT).word  # bit 63 set: negative as an int64
    word.host[0] = abort - (1 << 64)
    assert word.read() == abort
    word.clear()
    assert word.read() == 0 and word.host.item() == 0


@pytest.mark.parametrize("host", [torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)])
def test_a_word_is_one_int64_in_host_memory(host):
    with pytest.raises(ChunkringRuntimeError):
        FailureWord(host)


class Calls:
    def __init__(self, error: Exception | None = None) -> None:
        self.log: list[str] = []
        self.error = error

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def check(self) -> None:
        self.log.append("check")
        if self.error is not None:
            raise self.error


def test_an_unset_word_costs_no_synchronisation():
    calls = Calls(ChunkringDeviceError("never raised", None))
    raise_recorded_failure(0, rank=0, check=calls.check, synchronize=calls.synchronize)
    assert calls.log == []


def test_a_set_word_synchronises_then_raises_the_rings_own_error():
    record_error = ChunkringTimeoutError("PE 1: TIMEOUT while waiting for ...", None)
    calls = Calls(record_error)
    word = AbortRecord.make(2, 1, ErrorCode.TIMEOUT).word
    with pytest.raises(ChunkringTimeoutError) as info:
        raise_recorded_failure(word, rank=1, check=calls.check, synchronize=calls.synchronize)
    assert info.value is record_error and calls.log == ["synchronize", "check"]


def test_the_word_alone_names_the_error_when_the_record_says_nothing():
    calls = Calls()
    with pytest.raises(ChunkringPeerAbortedError) as info:
        raise_recorded_failure(AbortRecord.make(2, 3, ErrorCode.LAP_OVERFLOW).word, rank=1, check=calls.check,
                               synchronize=calls.synchronize)
    assert info.value.origin_rank == 3 and calls.log == ["synchronize", "check"]


def test_a_failing_kernel_that_never_ends_still_raises_the_words_error():
    """The word is stored before the abort, whose swap to a dead peer may never return: the synchronisation
    then times out, and the word alone names the error - with the timeout said - instead of hanging."""
    calls = Calls(ChunkringDeviceError("never read", None))

    def stuck() -> None:
        raise ChunkringRuntimeError("waited 3 s for this rank's kernels to end before reading its error record")

    with pytest.raises(ChunkringTimeoutError) as info:
        raise_recorded_failure(AbortRecord.make(2, 1, ErrorCode.TIMEOUT).word, rank=1, check=calls.check,
                               synchronize=stuck)
    assert "waited 3 s" in "\n".join(info.value.__notes__) and calls.log == []


def test_inside_a_capture_nothing_synchronises(monkeypatch):
    monkeypatch.setattr(chunkring.ring.failure, "capturing", lambda: True)
    calls = Calls(ChunkringDeviceError("needs a synchronisation", None))
    with pytest.raises(ChunkringTimeoutError, match="PE 0: TIMEOUT recorded by this rank's kernels"):
        raise_recorded_failure(AbortRecord.make(5, 0, ErrorCode.TIMEOUT).word, rank=0, check=calls.check,
                               synchronize=calls.synchronize)
    assert calls.log == []


def test_failure_error_names_this_rank_or_the_origin():
    own = failure_error(AbortRecord.make(1, 2, ErrorCode.HOST_USAGE).word, rank=2)
    assert type(own) is ChunkringDeviceError and "HOST_USAGE" in str(own) and "epoch 1" in str(own)
    assert isinstance(failure_error(AbortRecord.make(1, 2, ErrorCode.TIMEOUT).word, rank=2), ChunkringTimeoutError)
    peer = failure_error(AbortRecord.make(1, 0, ErrorCode.DOUBLE_ACK).word, rank=2)
    assert isinstance(peer, ChunkringPeerAbortedError) and (peer.origin_rank, peer.code) == (0, ErrorCode.DOUBLE_ACK)
    assert "PE 2: rank 0 recorded DOUBLE_ACK" in str(peer)
    with pytest.raises(ChunkringUsageError):
        failure_error(0, rank=0)


def words(**fields: int) -> list[int]:
    out = [0] * STATUS_WORDS
    for name, value in fields.items():
        out[STATUS[name]] = value
    return out


def test_the_abort_notice_stands_in_for_an_abort_word_that_never_landed():
    notice = AbortRecord.make(4, 5, ErrorCode.STALE_EPOCH).word
    error = status_error(words(abort_notice=notice), rank=1)
    assert isinstance(error, ChunkringPeerAbortedError) and error.origin_rank == 5
    first = AbortRecord.make(4, 6, ErrorCode.TIMEOUT).word
    error = status_error(words(abort=first, abort_notice=notice), rank=1)  # the first error wins where it landed
    assert isinstance(error, ChunkringPeerAbortedError) and error.origin_rank == 6


def test_a_host_usage_record_says_the_call_failed_its_checks_here():
    error = status_error(words(code=ErrorCode.HOST_USAGE, pe=3, site=Site.HOST_CHECK, count=1,
                               abort=AbortRecord.make(1, 3, ErrorCode.HOST_USAGE).word), rank=3)
    assert type(error) is ChunkringDeviceError
    assert str(error).startswith("PE 3: HOST_USAGE while checking a collective call's arguments on the host")
    assert "reset() to continue" in str(error)
