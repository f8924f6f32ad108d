"""A ring is zeroed (reset) and freed (destroy) only after every rank's kernels have ended and their NVSHMEM
operations completed, and no wait for the other ranks is unbounded (issue: fail closed): ``Ring.destroy`` and
``Ring.reset`` go through :meth:`chunkring.Runtime.quiesce` with a finite limit - the reset's from the ring's
watchdog, or its argument - before touching the buffer, and a rank that does not come leaves this rank's ring
as it was (nothing freed, nothing zeroed) with a typed error. The ring runs on the CPU over a stand-in runtime
(tests/helpers/host_runtime.py); Runtime.quiesce's own order is pinned in test_runtime_waits.py, the real
cross-rank timeout in tests/mpi/test_ring_reset_mpi.py."""

import pytest

from chunkring import ChunkringHostTimeoutError, ChunkringUsageError, PayloadFormat, RankInfo, Ring, RingSpec
from chunkring.hostcomm import HostComm
from chunkring.ring.layout import CONTROL
from chunkring.ring.ring import RESET_MARGIN_S, TEARDOWN_WAIT_S
from tests.helpers.host_runtime import HostOnlyRuntime

WATCHDOG_S = 7.0


def make_ring(runtime=None):
    runtime = runtime or HostOnlyRuntime(HostComm(RankInfo(0, 1, 0, 1)))
    spec = RingSpec(world_size=1, num_slots=2, tokens_per_slot=4, hidden=128, payload=PayloadFormat.FP8_E4M3,
                    topk=2, num_experts=4)
    return Ring(runtime, spec, timeout_s=WATCHDOG_S, transport="auto"), runtime


def test_destroy_waits_for_every_rank_with_a_bound_before_it_frees():
    ring, runtime = make_ring()
    runtime.events.clear()
    ring.close()
    assert runtime.events == [("quiesce", TEARDOWN_WAIT_S, "the ring's close()"), ("free", ring.buffer.data_ptr())]
    assert not runtime.live
    ring.close()  # a second call does nothing: no wait, no free
    assert len(runtime.events) == 2


def test_a_destroy_whose_peers_do_not_come_frees_nothing_and_says_so(monkeypatch):
    ring, runtime = make_ring()

    def absent_peer(timeout_s, *, what):
        raise ChunkringHostTimeoutError("rank 1 did not come", what=what, timeout_s=timeout_s, absent_ranks=(1,))

    monkeypatch.setattr(runtime, "quiesce", absent_peer)
    with pytest.raises(ChunkringHostTimeoutError) as info:
        ring.close(timeout_s=2.0)
    assert info.value.absent_ranks == (1,) and info.value.timeout_s == 2.0
    assert any("nothing was freed" in note for note in info.value.__notes__)
    assert ring.buffer.data_ptr() in runtime.live  # still allocated, and the ring still usable
    assert ring.epoch == 1


def test_reset_quiesces_before_zeroing_and_after_bounded_by_the_watchdog():
    ring, runtime = make_ring()
    assert ring.epoch == 1  # the constructor's reset
    ring.views["ack"].fill_(5)
    runtime.events.clear()
    ring.reset()
    limit = WATCHDOG_S + RESET_MARGIN_S
    assert runtime.events == [("quiesce", limit, "the reset's first barrier"),
                              ("quiesce", limit, "the reset's second barrier")]
    assert ring.epoch == 2 and not ring.views["ack"].any()


def test_reset_takes_an_explicit_bound_and_follows_set_timeout():
    ring, runtime = make_ring()
    runtime.events.clear()
    ring.reset(timeout_s=0.25)
    assert {e[1] for e in runtime.events} == {0.25}
    ring.set_timeout(3.0)
    runtime.events.clear()
    ring.reset()
    assert {e[1] for e in runtime.events} == {3.0 + RESET_MARGIN_S}


@pytest.mark.parametrize("bad", [0, -1.0, True, "1", float("inf")])
def test_a_bad_bound_is_refused_before_any_wait_and_abandons_the_peers_barrier(bad):
    ring, runtime = make_ring()
    runtime.events.clear()
    with pytest.raises(ChunkringUsageError) as info:
        ring.reset(timeout_s=bad)
    assert info.value.field == "timeout_s"
    with pytest.raises(ChunkringUsageError):
        ring.close(timeout_s=bad)
    # No wait and nothing zeroed or freed here; the peers, at the barrier this rank will not come to, are told.
    assert runtime.events == [("abandon",), ("abandon",)]


def test_a_reset_whose_peers_do_not_come_zeroes_nothing(monkeypatch):
    ring, runtime = make_ring()
    ring.views["ack"].fill_(5)

    def absent_peer(timeout_s, *, what):
        raise ChunkringHostTimeoutError("rank 1 did not come", what=what, timeout_s=timeout_s, absent_ranks=(1,))

    monkeypatch.setattr(runtime, "quiesce", absent_peer)
    with pytest.raises(ChunkringHostTimeoutError):
        ring.reset(timeout_s=1.0)
    assert int(ring.views["control"][CONTROL["epoch"]]) == 1 and bool(ring.views["ack"].eq(5).all())


@pytest.mark.parametrize("step", ["views", "transports", "descriptor", "allgather", "reset"])
def test_a_construction_that_fails_after_the_allocation_frees_the_buffer(monkeypatch, step):
    """Each step after the symmetric allocation - the views, the transports, the descriptor, the all-gather, the
    first reset - fails here in turn: the constructor frees the buffer (a collective every rank reaches alike) and
    raises the step's error; nothing stays allocated. A rank's own step abandons the all-gather's barrier first."""
    import chunkring.ring.ring as ring_module

    runtime = HostOnlyRuntime(HostComm(RankInfo(0, 1, 0, 1)))
    spec = RingSpec(world_size=1, num_slots=2, tokens_per_slot=4, hidden=128, payload=PayloadFormat.FP8_E4M3,
                    topk=2, num_experts=4)

    def fail(*args, **kwargs):
        raise MemoryError(f"injected: {step}")

    if step == "views":
        monkeypatch.setattr(ring_module.RingLayout, "views", fail)
    elif step == "transports":
        monkeypatch.setattr(ring_module, "choose_transports", fail)
    elif step == "descriptor":
        monkeypatch.setattr(ring_module.RingLayout, "descriptor", fail)
    elif step == "allgather":
        real = runtime.allgather_object
        monkeypatch.setattr(runtime, "allgather_object",
                            lambda obj, **kw: fail() if isinstance(obj, bool) else real(obj, **kw))
    else:
        monkeypatch.setattr(ring_module.Ring, "reset", fail)
    with pytest.raises(MemoryError, match=f"injected: {step}"):
        Ring(runtime, spec, timeout_s=WATCHDOG_S, transport="auto")
    assert not runtime.live, "the ring's buffer stays allocated"
    allocs = [e for e in runtime.events if e[0] == "alloc"]
    frees = [e for e in runtime.events if e[0] == "free"]
    assert len(allocs) == 1 and frees == [("free", allocs[0][1])]
    abandoned = ("abandon",) in runtime.events
    assert abandoned == (step in ("views", "transports", "descriptor")), runtime.events
