"""A call that fails on this rank's host anywhere - after its entry checks too - tells its peers (docs/INTEGRATION.md,
"Failing closed"), on the CPU with a real :class:`MoELayer` over host-only rings (tests/helpers/host_layer.py): a
warm call aborts its ring (``HOST_USAGE``) and this rank's next call raises at its entry, the failure word set by the
host at once; a mode's first call abandons its warm-up barrier exactly once, and only before reaching it (the real
:class:`CallSchedule` says whether it is still owed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import chunkring.errors
from chunkring.moe import CallMode
from chunkring.ring.status import AbortRecord, ErrorCode
from tests.helpers.host_layer import EPOCH, Launches, config, entry_points, host_layer, record_launches


@pytest.fixture
def launches(monkeypatch) -> Launches:
    return record_launches(monkeypatch)


class OutOfExpertMemory(torch.OutOfMemoryError):
    pass


@pytest.mark.parametrize("entry", ["run", "forward"])
def test_a_host_failure_after_the_pull_is_enqueued_aborts_the_ring_and_the_next_call_raises(monkeypatch, launches,
                                                                                             entry):
    """An error anywhere in a warm call - here out of memory for an expert buffer, raised by the schedule after the
    call's pull is enqueued - aborts the call's ring, so the peers waiting for this rank's acknowledgements stop at
    once instead of at their watchdog; and this rank's next call raises at its entry (the failure word is set by
    the host at once: the abort kernel may run after that call enters)."""
    layer = host_layer(monkeypatch, config())
    layer.schedule.warm.update(CallMode)
    calls = entry_points(layer)

    def enqueue_then_fail(call):
        layer.schedule.calls += 1
        raise OutOfExpertMemory("CUDA out of memory (gate_up)")

    layer.schedule.enqueue = enqueue_then_fail
    with pytest.raises(OutOfExpertMemory):
        calls[entry]()
    ring = layer.rings[CallMode.STREAMED if entry == "forward" else CallMode.BATCH_READY]
    assert launches.calls == [("ring_raise_abort", {"desc": ring.desc, "code": int(ErrorCode.HOST_USAGE)})]
    assert AbortRecord.from_word(ring.failure.read()) == AbortRecord.make(EPOCH, 0, ErrorCode.HOST_USAGE)
    with pytest.raises(chunkring.errors.ChunkringDeviceError, match="HOST_USAGE"):
        calls[entry]()
    assert layer.schedule.calls == 1 and len(launches.calls) == 2  # refused before the schedule; its ring aborted


@pytest.mark.parametrize("reached_barrier", [False, True])
def test_a_first_call_that_fails_abandons_the_warm_up_barrier_once_and_only_before_reaching_it(monkeypatch, launches,
                                                                                               reached_barrier):
    """A mode's first call that fails before its warm-up barrier (a GEMM build that fails, out of memory) abandons
    that barrier once, so the peers waiting there raise at once; one that fails at or after reaching it (the barrier
    itself raised on every rank) abandons nothing more: a second abandon would skip the ranks' next barrier."""
    layer = host_layer(monkeypatch, config())

    def enqueue_then_fail(call):
        layer.schedule.met_barrier = reached_barrier
        raise RuntimeError("the GEMM engine's first compile failed")

    layer.schedule.enqueue = enqueue_then_fail
    with pytest.raises(RuntimeError, match="first compile"):
        entry_points(layer)["run"]()
    assert layer.runtime.abandoned == (0 if reached_barrier else 1)
    assert launches.calls == []  # no kernel of the mode waits in its ring yet


def test_the_schedule_owes_the_first_barrier_until_it_reaches_it():
    """CallSchedule.owes_first_barrier, on the real schedule: owed at a mode's first call until the warm-up reaches
    the barrier (a failing warm-up leaves it owed; the barrier raising does not), never once the mode is warm."""
    from chunkring.moe._engine.schedule import CallSchedule

    events = []

    def barrier(timeout_s, what):
        events.append(what)
        if len(events) == 1:
            raise chunkring.errors.ChunkringHostTimeoutError("rank 1 gave up", what=what, timeout_s=timeout_s,
                                                             absent_ranks=())

    failing = SimpleNamespace(warm_up=lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("no build")))
    res = SimpleNamespace(compute=failing, pool=None, runtime=SimpleNamespace(host_barrier=barrier))
    schedule = CallSchedule(res)
    mode = CallMode.BATCH_READY
    schedule.begin_call()
    with pytest.raises(RuntimeError):
        schedule.warm_up(mode, None, None, None)
    assert schedule.owes_first_barrier(mode) and events == []
    res.compute = SimpleNamespace(warm_up=lambda *args, **kwargs: None)
    schedule.begin_call()
    with pytest.raises(chunkring.errors.ChunkringHostTimeoutError):
        schedule.warm_up(mode, None, None, None)
    assert not schedule.owes_first_barrier(mode) and not schedule.is_warm(mode)
    schedule.begin_call()
    assert schedule.owes_first_barrier(mode)  # the next first call meets a new barrier
    schedule.warm_up(mode, None, None, None)
    assert schedule.is_warm(mode) and not schedule.owes_first_barrier(mode)
    schedule.begin_call()
    assert not schedule.owes_first_barrier(mode)
