"""The fault matrix (issue: fail closed), under mpirun at 4 ranks under MPS: a fault on one rank (ORIGIN) -
a usage error, a device error (a watchdog limit of one microsecond), a hang (the rank never makes the call) -
at each phase of a layer's life - its first call, a streamed call, a CUDA-graph replay, the reset, the destroy.
What every other rank must see (the kill of a rank ends the job instead: test_fault_kill.py, via the launcher):

* call phases: a typed error naming the origin - ``ChunkringPeerAbortedError`` from its abort word within
  REPORT_WITHIN_S of the fault (device error); for a hang, within the configured limit, the watchdog's
  ``ChunkringTimeoutError`` whose record names the origin as the peer waited for, or the abort of a rank that
  timed out so, or - the first call's warm-up barrier - a ``ChunkringHostTimeoutError`` naming it absent. A
  survivor stopped by the abort of a survivor that timed out waiting for *another survivor* (stalled behind the
  hung rank) learns no name: the abort word carries the failing rank, not the rank it waited for - that cell
  then xfails, saying so. A usage error raises on the origin before any GPU work, and the origin tells its peers:
  at a mode's first call it abandons the warm-up barrier they wait at (``ChunkringHostTimeoutError`` naming it,
  at once), later it raises the ring's abort (``HOST_USAGE``: ``ChunkringPeerAbortedError`` naming it).
* reset / destroy: a usage error or a hang makes every other rank raise ``ChunkringHostTimeoutError`` naming the
  origin within the configured limit, with nothing zeroed or freed; a device error (a kernel of the origin failing
  while the reset or destroy is called) is waited for: no error, nothing zeroed or freed under it.

The failing call's own output, on every rank that made it, is the clean output bit for bit (its call completed) or
zeros (its kernels gave up) - never rows an earlier call left, which the cell would see: it fills the combine buffer
with NaN before the call. The reset and destroy cells go through the layer (``MoELayer.reset`` / ``destroy`` with a
bound). Then every rank rejoins and recovers: ``reset()`` restores the exact output (bit for bit the output of a clean
layer), or the destroy completes and the NVSHMEM heap is back where it was before the layer. Every rank records
what it saw as plain data; the assertions run on everyone's record after the allgather, so the ranks' collectives
stay in step whatever a cell finds. scripts/gpu_suite.sh runs it in its ``faults_mps`` part."""

import time

import pytest
import torch

from chunkring import MoELayer
from chunkring.moe._engine import schedule
from tests.helpers.layer_cells import Inputs, attempt, layer_config, rejoin

pytestmark = pytest.mark.gpu

#: The watchdog limit of the cells' layers: a hang is reported after about this long.
WATCHDOG_S = 3.0
#: How long a hung origin stays away: past every limit below.
HANG_S = WATCHDOG_S + 3.0
#: The bound of the waits a cell gives its reset and destroy, and the first call's warm-up barrier.
LIMIT_S = 1.0
REPORT_WITHIN_S = 1.0
#: What a report may take beyond its configured limit: the poll of the abort word, the host's reaction.
SLACK_S = 2.0
#: GPU cycles the origin's peers idle before their call in a device-error cell (~20 ms on an H200): the origin's
#: consumer must wait for them, so its one-microsecond watchdog fires.
DELAY_CYCLES = 40_000_000

CALL_PHASES = ("first_call", "streamed", "graph_replay")
PHASES = (*CALL_PHASES, "reset", "destroy")
FAULTS = ("usage", "device", "hang")
CELLS = [(fault, phase) for fault in FAULTS for phase in PHASES]


@pytest.fixture(scope="module")
def clean(runtime):
    """This rank's inputs, the heap before any layer, and the output of a clean layer's streamed call."""
    inputs = Inputs(runtime)
    before = runtime.symmetric_usage()
    layer = Layer(runtime, inputs)
    try:
        expected = layer.call(streaming=True)
        layer.layer.check()
    finally:
        layer.layer.close()
    return inputs, before, expected.cpu()


class Layer:
    """One cell's layer, its experts and (graph phase) its captured streamed call."""

    def __init__(self, runtime, inputs):
        self.runtime, self.inputs = runtime, inputs
        self.layer = MoELayer(runtime, layer_config(runtime.world_size), timeout_s=WATCHDOG_S)
        self.experts = inputs.experts(self.layer)
        self.graph, self.graph_out = None, None

    def enqueue(self, *, streaming=True, bad=False):
        x, sf, idx, w = self.inputs.args
        if bad:  # a usage error: topk_idx of the wrong dtype, refused before anything is enqueued
            idx = idx.to(torch.int64)
        return self.layer.run(x, sf, idx, w, *self.experts, streaming=streaming)

    def call(self, *, streaming=True):
        out = self.enqueue(streaming=streaming)
        torch.cuda.synchronize()
        return out

    def capture(self):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.graph_out = self.enqueue()

    def replay(self):
        self.graph.replay()
        torch.cuda.synchronize()
        return self.graph_out


@pytest.mark.lockstep
@pytest.mark.parametrize(("fault", "phase"), CELLS)
def test_fault_cell(runtime, clean, monkeypatch, fault, phase, record_testsuite_property):
    if runtime.world_size < 2:
        pytest.skip("a fault on one rank needs peers to report it")
    inputs, heap_before, expected = clean
    origin = runtime.world_size - 1
    mine = run_cell(runtime, Layer(runtime, inputs), fault, phase, origin, expected, heap_before, monkeypatch)
    everyone = runtime.allgather_object(mine)
    started = everyone[origin]["started"]
    for rank, seen in enumerate(everyone):
        if rank != origin and seen["error"] is not None:
            record_testsuite_property(f"{fault}_{phase}_report_ms_rank{rank}",
                                      round((seen["error"]["at"] - started) * 1e3, 1))
    check_cell(everyone, fault, phase, origin)


def run_cell(runtime, cell, fault, phase, origin, expected, heap_before, monkeypatch):
    """The cell's sequence on this rank, the same collectives on every rank whatever happens; what it saw."""
    me = runtime.rank == origin
    seen = {"rank": runtime.rank, "error": None, "recovered": None, "setup": None, "output": None}
    seen["setup"] = attempt(lambda: prepare(cell, phase))
    runtime.host_barrier(timeout_s=60, what="the cell's start")
    seen["started"] = time.time()
    with monkeypatch.context() as patch:
        # A first call's warm-up barrier waits this long (not 15 minutes) for a rank that never comes.
        patch.setattr(schedule, "FIRST_CALL_BARRIER_S", LIMIT_S)
        seen["error"] = attempt(lambda: strike(cell, fault, phase, me, expected, seen))
    if me and fault == "hang":
        time.sleep(HANG_S)
    seen["rejoin"] = attempt(lambda: rejoin(runtime))
    seen["recovered"] = recover(runtime, cell, fault, phase, me, expected, heap_before)
    return seen


def prepare(cell, phase):
    """Everything before the fault: a clean call (unless the fault strikes the first), the graph's capture."""
    if phase != "first_call":
        cell.call()
        cell.layer.check()
    if phase == "graph_replay":
        cell.capture()
        cell.replay()
        cell.layer.check()


def strike(cell, fault, phase, me, expected, seen):
    """The phase's action on every rank, the fault on the origin. Raises what this rank sees; the output of a call
    it made goes into ``seen["output"]`` (:func:`output_kind`), read before the error is."""
    layer = cell.layer
    if fault == "device" and me:
        layer.set_timeout(1e-6)
    if phase in CALL_PHASES:
        if me and fault == "hang":
            return
        if fault == "device" and not me:
            torch.cuda._sleep(DELAY_CYCLES)
        # What no call writes: a row of this buffer that a failed call's output took would show.
        layer.resources.combine.fill_(float("nan"))
        if me and fault == "usage":
            cell.enqueue(bad=True)
        out = cell.graph_out if phase == "graph_replay" else None
        if phase == "graph_replay":
            cell.graph.replay()
        else:
            out = cell.enqueue()
        torch.cuda.synchronize()
        seen["output"] = output_kind(out, expected)
        layer.check()
        return
    if fault == "device" and me:
        cell.enqueue()  # a kernel that fails on the device while the reset or destroy waits for it
    if me and fault == "hang":
        return
    limit = -1.0 if me and fault == "usage" else LIMIT_S
    if phase == "reset":
        layer.reset(timeout_s=limit)
    else:
        layer.close(timeout_s=limit)


def output_kind(out, expected) -> str:
    """A call's output as the docs allow it (docs/INTEGRATION.md, "Failing closed"): "exact" (the clean layer's, bit
    for bit: the call completed), "zeros" (its kernels gave up), or "wrong" - anything else, such as rows an
    earlier call left."""
    out = out.cpu()
    if torch.equal(out, expected):
        return "exact"
    return "zeros" if not bool(out.any()) else "wrong"


def recover(runtime, cell, fault, phase, me, expected, heap_before):
    """After the rejoin: a reset and the exact output again, or the destroy completed and the heap as before."""
    layer = cell.layer
    outcome = {"error": None, "exact": None, "heap_restored": None}

    def reset_and_call():
        if fault == "device" and me:
            layer.set_timeout(WATCHDOG_S)
        layer.reset()
        out = cell.replay() if phase == "graph_replay" else cell.call()
        layer.check()
        outcome["exact"] = bool(torch.equal(out.cpu(), expected))

    if phase != "destroy":
        outcome["error"] = attempt(reset_and_call)
    cell.graph = None
    destroyed = attempt(layer.close)
    outcome["error"] = outcome["error"] or destroyed
    outcome["heap_restored"] = runtime.symmetric_usage() == heap_before
    return outcome


def check_cell(everyone, fault, phase, origin):
    """The cell's expectations, on every rank's record (the same list on every rank: the same verdict)."""
    peers = [seen for seen in everyone if seen["rank"] != origin]
    mine = everyone[origin]
    assert all(seen["setup"] is None for seen in everyone), [seen["setup"] for seen in everyone]
    assert all(seen["rejoin"] is None for seen in everyone), [seen["rejoin"] for seen in everyone]
    wrong = [seen["rank"] for seen in everyone if seen["output"] == "wrong"]
    assert not wrong, f"rank(s) {wrong}: the failing call returned rows that are neither the exact output nor zeros"
    for seen in everyone:
        outcome = seen["recovered"]
        assert outcome["error"] is None, (seen["rank"], outcome["error"])
        assert outcome["heap_restored"], f"rank {seen['rank']}: the NVSHMEM heap did not return to its size"
        if phase != "destroy":
            assert outcome["exact"], f"rank {seen['rank']}: the output after reset() is not the clean one"
    if fault == "usage":
        assert mine["error"] and mine["error"]["kind"] == "ChunkringUsageError", mine["error"]
    if fault == "device" and phase in ("reset", "destroy"):
        # The reset or destroy waited for the origin's failing kernel: nobody zeroed or freed under it.
        assert all(seen["error"] is None for seen in everyone), [seen["error"] for seen in everyone]
        return
    unnamed = [seen["rank"] for seen in peers if not names_origin(seen, everyone, fault, phase, origin)]
    if unnamed and fault == "hang" and phase in CALL_PHASES[1:]:
        pytest.xfail(f"rank(s) {unnamed} stopped by the abort of a rank that timed out waiting for another survivor: "
                     f"the abort word names the rank that failed, not the rank it waited for")
    assert not unnamed, f"rank(s) {unnamed} got no error naming rank {origin}"


def names_origin(seen, everyone, fault, phase, origin):
    """Whether this survivor got a typed error in time (asserted) that names the origin (returned)."""
    error, started = seen["error"], everyone[origin]["started"]
    assert error is not None, f"rank {seen['rank']} saw no error"
    after = error["at"] - started
    if phase in ("reset", "destroy") or (phase == "first_call" and fault in ("usage", "hang")):
        # A bounded barrier the origin never reached.
        assert error["kind"] == "ChunkringHostTimeoutError", error
        assert after < LIMIT_S + SLACK_S, f"rank {seen['rank']}: {after:.2f} s"
        return origin in error["absent"]
    if fault == "hang":  # the watchdog of a wait for the origin, or the abort of a rank whose wait it was
        assert error["kind"] in ("ChunkringTimeoutError", "ChunkringPeerAbortedError"), error
        assert after < WATCHDOG_S + SLACK_S, f"rank {seen['rank']}: {after:.2f} s"
        return waited_for(error, origin) or (error["kind"] == "ChunkringPeerAbortedError" and waited_for(
            everyone[error["origin_rank"]]["error"], origin))
    # The origin's abort word, within a second of the fault.
    assert after < REPORT_WITHIN_S, f"rank {seen['rank']}: {error['kind']} {after:.2f} s after the fault"
    return error["kind"] == "ChunkringPeerAbortedError" and error["origin_rank"] == origin


def waited_for(error, origin):
    return error is not None and error["kind"] == "ChunkringTimeoutError" and error["peer"] == origin
