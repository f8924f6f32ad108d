"""Fail fast across ranks (docs/PROTOCOL.md, "Timeouts and errors"): a rank that records an error raises the
ring's abort word on every rank, so its peers stop waiting at once - each names the rank that failed - instead
of spinning until their own watchdog; a reset clears it and the ring works again.

The fault is a real protocol error, injected the way the stale-epoch tests do: the last rank's ready words of
its own slot 0 hold a generation of the previous epoch (a late signal of an aborted run) and it publishes
nothing. Its consumer reaches that source after every other source's chunk and reports STALE_EPOCH; every other
consumer waits for the last rank's chunk, which never comes. Ranks share one host clock (one node), so the
time from the faulting rank's gather launch to each peer's report is measured across processes; it bounds the
time from the fault itself, which comes later."""

import time

import pytest
import torch

from chunkring import ChunkringDeviceError, ChunkringPeerAbortedError
from chunkring.ring.io import GatherOutputs, gather
from chunkring.ring.status import ErrorCode, Site
from tests.gpu.ring_helpers import T, check_gathered, make_ring, publish_all

pytestmark = pytest.mark.gpu

#: Far above how long the peers should take, so only the abort word can make them report in time.
WATCHDOG_S = 60.0
REPORT_WITHIN_S = 1.0


def arm_the_fault(runtime, ring, faulty):
    """After a reset: the faulty rank's own ready words of slot 0 get the previous epoch's lap-0 generation;
    every other rank publishes one full chunk (its whole stream). Returns after every rank is armed."""
    if runtime.rank == faulty:
        stale = ((ring.epoch - 1) << (64 - ring.spec.epoch_bits)) | 1
        for name in ("route_ready", "layout_ready"):
            ring.views[name][faulty, 0] = stale
    else:
        publish_all(runtime, ring, T, 1, torch.cuda.current_stream())
    torch.cuda.synchronize()
    runtime.barrier()


def raised_by_check(ring):
    try:
        ring.check()
    except ChunkringDeviceError as error:
        return error
    return None


def assert_the_fault_is_reported(runtime, ring, error, faulty):
    abort = ring.abort_status()
    assert (abort.origin, abort.code, abort.epoch) == (faulty, ErrorCode.STALE_EPOCH, ring.epoch), abort
    if runtime.rank == faulty:  # this rank failed: its own error, not a peer's
        assert type(error) is ChunkringDeviceError, error
        assert (error.record.code, error.record.site, error.record.peer) == (ErrorCode.STALE_EPOCH, Site.WAIT_ROUTE,
                                                                            faulty), error
    else:
        assert isinstance(error, ChunkringPeerAbortedError), error
        assert (error.origin_rank, error.code, error.epoch) == (faulty, ErrorCode.STALE_EPOCH, ring.epoch), error
        assert f"rank {faulty} recorded STALE_EPOCH" in str(error)


def run_again_after_reset(runtime, ring):
    runtime.barrier()
    ring.reset()
    assert not ring.abort_status().raised
    out = GatherOutputs(ring, T)
    publish_all(runtime, ring, T, 2, torch.cuda.current_stream())
    gather(ring, out)
    check_gathered(runtime, ring, out, [T] * runtime.world_size, 2)
    out.close()


def test_a_faulting_rank_stops_every_waiting_peer_within_a_second(runtime, record_testsuite_property):
    W, rank = runtime.world_size, runtime.rank
    faulty = W - 1
    with make_ring(runtime, 1, timeout_s=WATCHDOG_S) as ring:
        out = GatherOutputs(ring, T)  # a normal call first: every kernel loaded before anything is timed
        publish_all(runtime, ring, T, 0, torch.cuda.current_stream())
        gather(ring, out)
        check_gathered(runtime, ring, out, [T] * W, 0)
        runtime.barrier()
        out.close()
        ring.reset()
        arm_the_fault(runtime, ring, faulty)

        out = GatherOutputs(ring, T)
        start = time.time()
        gather(ring, out)
        torch.cuda.synchronize()
        error = raised_by_check(ring)
        reported = time.time()

        assert_the_fault_is_reported(runtime, ring, error, faulty)
        if rank != faulty:  # the wait the abort stopped: the faulty rank's chunk, never published
            record = ring.status()
            assert (record.code, record.site, record.peer, record.slot) == (ErrorCode.PEER_ABORTED, Site.WAIT_ROUTE,
                                                                            faulty, 0), record
        fault_start = runtime.allgather_object(start)[faulty]
        took = reported - fault_start
        if rank != faulty:
            record_testsuite_property(f"abort_report_ms_rank{rank}", round(took * 1e3, 3))
        took_by_rank = runtime.allgather_object(took)
        peers = [t for r, t in enumerate(took_by_rank) if r != faulty]
        if peers and rank == 0:
            record_testsuite_property("abort_report_ms_max", round(max(peers) * 1e3, 3))
        assert all(t < REPORT_WITHIN_S for t in peers), (
            f"peers reported {[round(t, 3) for t in peers]} s after the faulty rank's launch")
        out.close()
        run_again_after_reset(runtime, ring)


def test_an_idle_rank_learns_of_a_peer_failure_from_its_abort_notice(runtime):
    """No kernel of the other ranks runs while the last rank fails: their next check() still names it, because
    the abort's notices landed (its quiet) before the faulty rank's kernel ended."""
    W, rank = runtime.world_size, runtime.rank
    if W < 2:
        pytest.skip("a peer's abort needs two ranks")
    faulty = W - 1
    with make_ring(runtime, 1, timeout_s=WATCHDOG_S) as ring:
        arm_the_fault(runtime, ring, faulty)
        out = GatherOutputs(ring, T)  # a collective: every rank makes them, the faulty one alone gathers
        if rank == faulty:
            gather(ring, out)
            torch.cuda.synchronize()
        runtime.barrier()  # the faulty rank's kernel has ended
        out.close()
        error = raised_by_check(ring)
        assert_the_fault_is_reported(runtime, ring, error, faulty)
        if rank != faulty:
            assert ring.status().ok, "no wait of this rank ran: the abort word alone must name the failure"
        run_again_after_reset(runtime, ring)
