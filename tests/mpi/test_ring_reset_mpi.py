"""Recovery cannot hang (issue: fail closed): across real ranks, a ``Ring.reset`` or ``Ring.destroy`` that one
rank skips makes every other rank raise ``ChunkringHostTimeoutError`` naming that rank within the limit, with
nothing zeroed or freed; the rank that comes late raises naming who gave up; and once every rank calls again
together, the reset works. The ring lives on the CPU over a stand-in runtime (tests/helpers/host_runtime.py)
whose barrier is the real bounded one of chunkring.hostcomm.HostComm, over MPI (mpirun, no GPU)."""

import time

import pytest

from chunkring import ChunkringHostTimeoutError, ChunkringUsageError, PayloadFormat, Ring, RingSpec
from chunkring.hostcomm import HostComm
from tests.helpers.host_runtime import HostOnlyRuntime

LIMIT_S = 0.5


def make_ring():
    runtime = HostOnlyRuntime(HostComm.from_env())
    spec = RingSpec(world_size=runtime.world_size, num_slots=2, tokens_per_slot=4, hidden=128,
                    payload=PayloadFormat.BF16, topk=2, num_experts=2 * runtime.world_size)
    return Ring(runtime, spec, timeout_s=30.0, transport="auto"), runtime


@pytest.mark.mpi(min_size=2)
def test_a_reset_one_rank_skips_names_it_on_every_other_rank():
    ring, runtime = make_ring()
    rank, skipper = runtime.rank, runtime.world_size - 1
    ring.views["ack"].fill_(7)
    if rank == skipper:
        time.sleep(3 * LIMIT_S)  # busy elsewhere: the others' limit passes
        with pytest.raises(ChunkringHostTimeoutError) as info:
            ring.reset(timeout_s=60)  # comes late: the others gave up, so it must not zero alone
        assert info.value.gave_up_ranks and skipper not in info.value.gave_up_ranks
    else:
        started = time.monotonic()
        with pytest.raises(ChunkringHostTimeoutError) as info:
            ring.reset(timeout_s=LIMIT_S)
        assert time.monotonic() - started < LIMIT_S + 2.0
        assert info.value.absent_ranks == (skipper,) and info.value.what == "the reset's first barrier"
    assert ring.epoch == 1 and bool(ring.views["ack"].eq(7).all())  # nothing zeroed anywhere
    runtime.comm.barrier(timeout_s=60)
    ring.reset(timeout_s=60)  # every rank together: the reset works
    assert ring.epoch == 2 and not ring.views["ack"].any()
    ring.close(timeout_s=60)


@pytest.mark.mpi(min_size=2)
def test_a_destroy_one_rank_is_late_for_frees_nothing_anywhere():
    ring, runtime = make_ring()
    rank, late = runtime.rank, 0
    if rank == late:
        time.sleep(3 * LIMIT_S)
        with pytest.raises(ChunkringHostTimeoutError) as info:
            ring.close(timeout_s=60)
        assert info.value.gave_up_ranks and late not in info.value.gave_up_ranks
    else:
        with pytest.raises(ChunkringHostTimeoutError) as info:
            ring.close(timeout_s=LIMIT_S)
        assert info.value.absent_ranks == (late,)
        assert any("nothing was freed" in note for note in info.value.__notes__)
    assert ring.buffer.data_ptr() in runtime.live
    runtime.comm.barrier(timeout_s=60)
    ring.close(timeout_s=60)  # every rank together: freed
    assert not runtime.live and ("free", ring.buffer.data_ptr()) in runtime.events


@pytest.mark.mpi(min_size=2)
def test_a_reset_one_rank_refuses_is_named_at_once_on_every_other_rank():
    """A bad bound is that rank's own usage error: it abandons the barrier, so the others do not wait out theirs."""
    ring, runtime = make_ring()
    rank, refuser = runtime.rank, runtime.world_size - 1
    if rank == refuser:
        with pytest.raises(ChunkringUsageError):
            ring.reset(timeout_s=-1.0)
    else:
        started = time.monotonic()
        with pytest.raises(ChunkringHostTimeoutError) as info:
            ring.reset(timeout_s=60)
        assert time.monotonic() - started < 5.0, "waited for a rank that had said it would not come"
        assert info.value.absent_ranks == (refuser,) and info.value.gave_up_ranks == (refuser,)
    runtime.comm.barrier(timeout_s=60)
    ring.reset(timeout_s=60)  # every rank together: the barriers line up again
    assert ring.epoch == 2
    ring.close(timeout_s=60)
