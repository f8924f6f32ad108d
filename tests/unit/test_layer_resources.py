"""A layer's construction is all or nothing on every rank (chunkring.moe.resources.agree): a step that can fail
on one rank only is run everywhere, then the ranks compare outcomes before any collective allocation, so a rank
never waits in an allocation its peers left - every rank raises, naming each failed rank and why."""

from types import SimpleNamespace

import pytest

from chunkring import ChunkringRuntimeError, ChunkringUsageError
from chunkring.moe.resources import agree


def runtime_seeing(outcomes):
    """A stand-in runtime whose allgather returns ``outcomes`` (every rank's (error name, message) or None)."""
    return SimpleNamespace(allgather_object=lambda mine: outcomes)


def test_a_step_that_succeeds_everywhere_returns():
    ran = []
    agree(runtime_seeing([None, None]), lambda: ran.append(1))
    assert ran == [1]


def test_the_one_rank_that_failed_raises_its_own_error():
    def fail():
        raise ChunkringUsageError("waves > 1 needs DIRECT peers", field="waves")

    with pytest.raises(ChunkringUsageError) as info:
        agree(runtime_seeing([("ChunkringUsageError", "waves: ..."), None]), fail)
    assert info.value.field == "waves"  # unchanged: the rank's own error


def test_a_rank_that_succeeded_raises_when_a_peer_failed():
    peers = [None, ("ChunkringRuntimeError", "the FP8 expert GEMMs need DeepGEMM")]
    with pytest.raises(ChunkringRuntimeError, match=r"rank 1: ChunkringRuntimeError: the FP8 expert GEMMs"):
        agree(runtime_seeing(peers), lambda: None)


def test_usage_errors_everywhere_stay_usage_errors_and_name_every_rank():
    def fail():
        raise ChunkringUsageError("too small to split", field="partition")

    outcomes = [("ChunkringUsageError", "partition: too small"), ("ChunkringUsageError", "partition: too small")]
    with pytest.raises(ChunkringUsageError, match=r"rank 0: .*rank 1: "):
        agree(runtime_seeing(outcomes), fail)
    mixed = [("ChunkringUsageError", "a"), ("RuntimeError", "b")]
    with pytest.raises(ChunkringRuntimeError):
        agree(runtime_seeing(mixed), fail)
