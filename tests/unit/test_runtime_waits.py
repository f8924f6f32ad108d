"""The runtime's waits on other ranks settle the GPU first and are bounded (issue: fail closed):
``Runtime.quiesce`` - the rule before symmetric memory is zeroed or freed - waits for every kernel of the device,
then completes the NVSHMEM operations they issued (a stream-ordered quiet: a kernel's end completes its stores,
not its PE's outstanding RMA), then meets the other ranks at a bounded host barrier; ``Runtime.barrier`` does the
same for torch's current stream, with a finite default limit instead of NVSHMEM's unbounded ``barrier_all``; the
object collectives and the symmetric allocations and frees hold a bounded roll call first. GPU calls are replaced by
recorders (no GPU here)."""

import threading
import time
from types import SimpleNamespace

import nvshmem.core
import pytest
import torch

from chunkring import ChunkringHostTimeoutError, RankInfo, Runtime
from chunkring.errors import ChunkringWedgedError
from chunkring.runtime import PEER_WAIT_S

TWO = RankInfo(0, 2, 0, 2)


@pytest.fixture
def recorded(monkeypatch):
    """A two-rank runtime whose GPU and host-collective calls are recorded, in order, into the returned list."""
    calls = []
    stream = SimpleNamespace(synchronize=lambda: calls.append("stream sync"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("device sync", device)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(nvshmem.core, "quiet", lambda stream=None: calls.append("quiet"))
    comm = SimpleNamespace(ranks=TWO, barrier=lambda timeout_s, *, what: calls.append(("barrier", timeout_s, what)),
                           abandon_barrier=lambda: calls.append("abandon"),
                           allgather_object=lambda obj: calls.append(("allgather", obj)) or [obj, obj],
                           gather_object=lambda obj, root: calls.append(("gather", obj)) or [obj, obj],
                           broadcast_object=lambda obj, root: calls.append(("bcast", obj)) or obj)
    rt = Runtime(ranks=TWO, ordinal=3, device=None, comm=comm)
    return rt, calls


def test_quiesce_waits_for_the_device_then_quiets_then_meets_every_rank(recorded):
    rt, calls = recorded
    rt.quiesce(12.5, what="the ring's close()")
    assert calls == [("device sync", 3), "quiet", "stream sync", ("barrier", 12.5, "the ring's close()")]


def test_barrier_quiets_the_current_stream_and_is_bounded_by_default(recorded):
    rt, calls = recorded
    rt.barrier()
    assert calls == ["quiet", "stream sync", ("barrier", PEER_WAIT_S, "a barrier")]
    assert 0 < PEER_WAIT_S < float("inf")


def test_object_collectives_hold_a_bounded_roll_call_first(recorded):
    rt, calls = recorded
    assert rt.allgather_object(1) == [1, 1]
    rt.gather_object(2)
    rt.broadcast_object(3, timeout_s=4.0)
    rt.allgather_object(5, timeout_s=None)  # a caller that a supervisor bounds: no roll call
    assert calls == [("barrier", PEER_WAIT_S, "an allgather"), ("allgather", 1),
                     ("barrier", PEER_WAIT_S, "a gather"), ("gather", 2),
                     ("barrier", 4.0, "a broadcast"), ("bcast", 3), ("allgather", 5)]


def test_symmetric_usage_counts_live_allocations(recorded, monkeypatch):
    """What the lifetime test reads for NVSHMEM heap use: every alloc counted until its free."""
    rt, _ = recorded
    monkeypatch.setattr(nvshmem.core, "tensor", lambda shape, dtype: torch.ones(shape, dtype=dtype))
    monkeypatch.setattr(nvshmem.core, "free_tensor", lambda tensor: None)
    assert rt.symmetric_usage() == (0, 0)
    a = rt.alloc((4, 8), torch.float32)
    b = rt.alloc(10, torch.uint8)
    assert rt.symmetric_usage() == (2, 4 * 8 * 4 + 10)
    assert not a.any()  # zero-filled
    rt.free(a)
    assert rt.symmetric_usage() == (1, 10)
    rt.free(b)
    assert rt.symmetric_usage() == (0, 0)


def test_symmetric_allocations_and_frees_hold_a_bounded_roll_call_first(recorded, monkeypatch):
    """NVSHMEM's malloc and free wait for every PE with no limit: a rank that never comes is found first. A free
    whose peers did not come keeps its tensor (counted, still valid) for a later free."""
    rt, calls = recorded
    monkeypatch.setattr(nvshmem.core, "tensor", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    freed = []
    monkeypatch.setattr(nvshmem.core, "free_tensor", freed.append)
    a = rt.alloc(4, torch.int64)
    assert calls[0] == ("barrier", PEER_WAIT_S, "a symmetric allocation")

    def absent(timeout_s, *, what):
        raise ChunkringHostTimeoutError("rank 1 did not come", what=what, timeout_s=timeout_s, absent_ranks=(1,))

    rt.comm.barrier = absent
    with pytest.raises(ChunkringHostTimeoutError):
        rt.free(a, timeout_s=0.5)
    assert rt.symmetric_usage() == (1, 32) and freed == []
    rt.comm.barrier = lambda timeout_s, *, what: calls.append(("barrier", timeout_s, what))
    rt.free(a)
    assert freed == [a] and rt.symmetric_usage() == (0, 0)
    assert calls[-1] == ("barrier", PEER_WAIT_S, "a symmetric free")


def test_a_device_that_never_idles_makes_quiesce_raise_within_its_limit(recorded, monkeypatch):
    """torch.cuda.synchronize takes no limit: a kernel stuck on a dead peer's remote operation would hold the host
    for ever. The runtime waits on a helper thread instead, and raises once the limit passes, meeting nobody."""
    rt, calls = recorded
    stuck = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: stuck.wait())
    started = time.monotonic()
    with pytest.raises(ChunkringWedgedError, match=r"waited 0.2 s for this rank's kernels to end before the reset"):
        rt.quiesce(0.2, what="the reset")
    assert time.monotonic() - started < 5.0
    # No quiet and no barrier after it; the barrier abandoned instead, so the peers raise at once, in step.
    assert calls == ["abandon"]
    rt.close()  # wedged: frees nothing and finalises nothing (each would wait on the stuck kernel)
    stuck.set()


def test_what_the_wait_raises_is_raised_to_the_caller(recorded, monkeypatch):
    rt, _ = recorded

    def failing(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", failing)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rt.synchronize(5.0, what="a test")
