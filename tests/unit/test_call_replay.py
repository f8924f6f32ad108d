"""Eager calls replayed from CUDA graphs (chunkring.moe._engine.replay.CallGraphs), on the CPU with stand-ins for the
graph and the schedule: the first call of a kind runs directly and its graph is captured over the fixed buffers
(the bucket's rows, the count read from the device, the fixed output); a later call of that kind - any size up to its
bucket - copies its inputs in, writes its count, replays and copies its rows out; what makes a kind (bucket, mode,
chunk, engine, weights, router, batch kind) each makes another graph; the calls that need the host inside them run
directly; a failed capture leaves its kind direct; a full cache keeps the graphs it replays and drops only a stale one
for a new kind.
Each test runs twice: with every graph copying, and with routed calls' graphs rebound to each call's own tensors (a
rebound replay copies nothing in or out, and leaves the fixed buffers as they were).

The stand-in graph records the staged call its capture enqueued and, at a replay, computes what the layer would from
the fixed buffers the staged call names - or, rebound, from the tensors its last rebinding named - (twice the rows, up
to the device count; zeros past it), so the checks see exactly what the graph would read and write.
tests/unit/test_rebind.py checks how a rebinding moves a node's addresses; tests/gpu/test_call_replay_gpu.py replays
real graphs."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from chunkring import PayloadFormat
from chunkring.errors import ChunkringRuntimeError
from chunkring.moe import CallMode, MoEConfig
from chunkring.moe._engine import replay as replay_module
from chunkring.moe._engine.call import Call, HiddenBatch, RoutedBatch
from chunkring.moe._engine.rebind import NotRebindable
from chunkring.moe._engine.replay import CallGraphs, bucket

H, K, N = 128, 2, 64
CFG = MoEConfig(num_experts=4, hidden=H, intermediate=128, topk=K, max_tokens_per_rank=N, payload=PayloadFormat.BF16,
                stream_slots=2, stream_slot_tokens=16)


def compute(call: Call) -> torch.Tensor:
    """What the stand-in layer computes of a call: twice each real row (the count on the device, if any)."""
    batch = call.batch
    x = batch.x if isinstance(batch, RoutedBatch) else batch.hidden
    real = call.n if call.num_tokens is None else int(call.num_tokens[0])
    out = torch.zeros(call.n, H, dtype=torch.bfloat16)
    out[:real] = x[:real].float() * 2
    return out


class Graph:
    """A CUDA graph stand-in: its capture records the staged call; a replay recomputes it from the fixed buffers."""

    capturing: Graph | None = None
    fail = False
    rebinds = False  # whether the fixture's rebinding rebinds routed calls' graphs
    made: list[Graph] = []

    def __init__(self, keep_graph: bool = False) -> None:
        assert keep_graph, "a rebinding reads the kept graph's nodes"
        self.staged: Call | None = None
        self.bound: tuple[tuple[torch.Tensor | None, ...], int] | None = None  # the last rebinding's tensors, rows
        self.replays = 0
        Graph.made.append(self)

    def instantiate(self) -> None:
        assert self.staged is not None, "instantiated after its capture"

    def replay(self) -> None:
        assert self.staged is not None and self.staged.out is not None
        call = self.staged
        if self.bound is not None:
            (x, x_sf, idx, w, out), rows = self.bound
            call = Call(**{**call.__dict__, "batch": RoutedBatch(x, x_sf, idx, w), "n": rows, "out": out})
        call.out.copy_(compute(call))
        self.replays += 1


class Rebinding:
    """A rebinding stand-in: ``apply`` points its graph at a call's own tensors, as the real one sets its nodes."""

    def __init__(self, graph: Graph, buffers: tuple[torch.Tensor, ...]) -> None:
        assert len(buffers) == 5 and buffers[-1].data_ptr() == graph.staged.out.data_ptr(), "the inputs, the output"
        self.graph, self.buffers = graph, buffers

    fail = False  # whether the driver refuses the next parameter set

    def apply(self, tensors: tuple[torch.Tensor | None, ...], rows: int) -> None:
        assert len(tensors) == len(self.buffers)
        if Rebinding.fail:
            raise ChunkringRuntimeError("setting moe_combine_reduce's node parameters: CUDA_ERROR_INVALID_VALUE")
        self.graph.bound = (tensors, rows)


class Schedule:
    def __init__(self) -> None:
        self.direct: list[Call] = []
        self.warm = set(CallMode)

    def is_warm(self, mode: CallMode) -> bool:
        return mode in self.warm

    def enqueue(self, call: Call) -> torch.Tensor:
        if Graph.capturing is not None:
            if Graph.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            Graph.capturing.staged = call
            return call.out
        self.direct.append(call)
        out = compute(call)
        return out if call.out is None else call.out.copy_(out)


@contextlib.contextmanager
def graph_context(graph: Graph, pool=None, capture_error_mode="global"):
    Graph.capturing = graph
    try:
        yield
    finally:
        Graph.capturing = None


@pytest.fixture(params=["copying", "rebound"])
def graphs(request, monkeypatch) -> CallGraphs:
    def rebinding(graph: Graph, buffers: tuple[torch.Tensor, ...], rows: int, *,
                  must_move: tuple[int, ...]) -> Rebinding:
        assert must_move == (0, 4) and rows == graph.staged.n, "the rows and the output, for the bucket's rows"
        if not Graph.rebinds:
            raise NotRebindable("the stand-in copies")
        return Rebinding(graph, buffers)

    monkeypatch.setattr(replay_module, "rebinding", rebinding)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph_context)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    Graph.fail, Graph.made, Graph.rebinds, Rebinding.fail = False, [], request.param == "rebound", False
    res = SimpleNamespace(config=CFG, runtime=SimpleNamespace(torch_device=torch.device("cpu")))
    return CallGraphs(res, Schedule())


WEIGHTS = (torch.zeros(2, 256, H), torch.zeros(2, H, 128))


def routed(n: int, mode: CallMode = CallMode.BATCH_READY, *, chunk=None, weights=WEIGHTS, seed: int = 0, **fields):
    gen = torch.Generator().manual_seed(seed)
    batch = RoutedBatch(torch.randn(n, H, generator=gen).bfloat16(), None,
                        torch.randint(0, 4, (n, K), generator=gen, dtype=torch.int32), torch.rand(n, K, generator=gen))
    call = Call(mode, batch, n, chunk, *weights, None, None, None, False)
    return Call(**{**call.__dict__, **fields})


def issue(graphs: CallGraphs, call: Call) -> torch.Tensor:
    """What MoELayer._issue does with a resolved call."""
    out = graphs.replay(call)
    if out is None:
        out = graphs.schedule.enqueue(call)
        graphs.capture(call)
    return out


def test_buckets_are_powers_of_two_up_to_the_capacity():
    assert [bucket(n, 64) for n in (1, 2, 3, 4, 5, 31, 32, 33, 63, 64)] == [1, 2, 4, 4, 8, 32, 32, 64, 64, 64]
    assert bucket(40, 48) == 48


def test_the_first_call_runs_directly_and_captures_its_buckets_graph_over_the_fixed_buffers(graphs):
    call = routed(5)
    out = issue(graphs, call)
    assert torch.equal(out, compute(call)) and graphs.schedule.direct == [call]
    assert len(graphs) == 1
    (graph,) = Graph.made
    staged = graph.staged
    assert staged.n == 8 and staged.num_tokens is not None and staged.num_tokens.shape == (1,)
    assert staged.out.shape == (8, H) and staged.batch.x.shape == (8, H)
    assert (staged.mode, staged.chunk, staged.decode, staged.timeline) == (call.mode, call.chunk, call.decode, None)


@pytest.mark.parametrize("n", [5, 8, 6])
def test_later_calls_of_the_kind_replay_with_their_own_rows_and_count(graphs, n):
    issue(graphs, routed(7, seed=1))  # bucket 8
    call = routed(n, seed=2)
    out = issue(graphs, call)
    assert len(graphs.schedule.direct) == 1, "replayed, not run directly"
    assert torch.equal(out, compute(call)) and out.shape == (n, H)
    user_out = torch.full((n, H), float("nan"), dtype=torch.bfloat16)
    again = graphs.replay(routed(n, seed=2, out=user_out))
    assert again is user_out and torch.equal(user_out, compute(call))


def test_a_replay_writes_its_count_only_where_it_differs_from_the_last_replays(graphs):
    issue(graphs, routed(7, seed=1))  # bucket 8
    (graph,) = Graph.made
    count = graph.staged.num_tokens  # the device count the graph reads
    call = routed(5, seed=2)
    assert torch.equal(graphs.replay(call), compute(call)) and int(count[0]) == 5
    count.fill_(2)  # what no kernel does: a replay of as many rows leaves the count as it finds it
    stale = graphs.replay(routed(5, seed=3))
    assert int(count[0]) == 2 and stale[:2].any() and not stale[2:].any()
    call = routed(6, seed=4)
    assert torch.equal(graphs.replay(call), compute(call)) and int(count[0]) == 6
    graphs.clear()  # new buffers, a new count: the first replay writes it
    Graph.made.clear()
    issue(graphs, routed(6, seed=5))
    call = routed(6, seed=6)
    assert torch.equal(issue(graphs, call), compute(call))


def test_what_makes_a_kind_each_makes_another_graph(graphs):
    other_weights = (torch.zeros(2, 256, H), torch.zeros(2, H, 128))
    kinds = [routed(5), routed(20), routed(5, CallMode.STREAMED, chunk=16), routed(5, CallMode.STREAMED, chunk=8),
             routed(5, decode=True), routed(5, weights=other_weights)]
    hidden = HiddenBatch(torch.randn(5, H).bfloat16(), torch.zeros(4, H, dtype=torch.bfloat16), None,
                         torch.zeros(1, dtype=torch.int32), 1)
    kinds.append(Call(**{**routed(5).__dict__, "batch": hidden}))
    for call in kinds:
        assert graphs.replay(call) is None
        issue(graphs, call)
    assert len(graphs) == len(kinds) == len(graphs.schedule.direct)
    for call in kinds:  # each replays now
        assert torch.equal(graphs.replay(call), compute(call))


@pytest.mark.parametrize("field, value", [("timeline", object()), ("num_tokens", torch.ones(1, dtype=torch.int32)),
                                          ("n", 0)])
def test_calls_that_need_the_host_run_directly(graphs, field, value):
    call = routed(0 if field == "n" else 5)
    call = Call(**{**call.__dict__, field: value})
    issue(graphs, call)
    issue(graphs, call)
    assert len(graphs) == 0 and len(graphs.schedule.direct) == 2


def test_a_modes_first_call_runs_directly_and_a_disabled_layer_never_replays(graphs):
    graphs.schedule.warm.clear()  # the warm-up and its barrier: the schedule's direct path
    issue(graphs, routed(5))
    assert len(graphs) == 0
    graphs.schedule.warm.update(CallMode)
    graphs.enabled = False
    issue(graphs, routed(5))
    issue(graphs, routed(5))
    assert len(graphs) == 0 and len(graphs.schedule.direct) == 3


def test_a_capture_that_fails_leaves_its_kind_direct(graphs, caplog):
    Graph.fail = True
    with caplog.at_level(logging.WARNING, logger="chunkring"):
        out = issue(graphs, routed(5))
    assert torch.equal(out, compute(routed(5))) and "could not be captured" in caplog.text
    Graph.fail = False
    issue(graphs, routed(5))
    assert len(graphs) == 0 and len(graphs.schedule.direct) == 2, "not captured again"


def test_a_full_cache_keeps_replaying_what_it_holds_when_more_kinds_cycle_through_it(graphs, monkeypatch):
    # A model's layers called in a cycle of more kinds than the cache holds: a least-recently-used cache would miss
    # and capture on every call; this one captures the first two kinds and runs the third directly every time.
    monkeypatch.setattr(replay_module, "MAX_GRAPHS", 2)
    monkeypatch.setattr(replay_module, "STALE_CALLS", 4)
    for _ in range(5):
        for n in (1, 2, 4):
            call = routed(n, seed=n)
            assert torch.equal(issue(graphs, call), compute(call))
    assert len(Graph.made) == 2 and len(graphs) == 2, "nothing captured past the first cycle"
    assert [c.n for c in graphs.schedule.direct] == [1, 2] + [4] * 5
    assert sum(graph.replays for graph in Graph.made) == 2 * 4


def test_a_full_cache_drops_a_stale_graph_for_a_new_kind(graphs, monkeypatch):
    monkeypatch.setattr(replay_module, "MAX_GRAPHS", 2)
    monkeypatch.setattr(replay_module, "STALE_CALLS", 4)
    for n in (1, 2):
        issue(graphs, routed(n))
    for _ in range(3):
        issue(graphs, routed(2))
    # The sixth replayable call: the bucket-1 graph, last used by the first, is 5 >= STALE_CALLS calls old.
    issue(graphs, routed(8))  # runs directly, and its graph takes the stale one's place
    assert len(graphs) == 2 and len(Graph.made) == 3
    assert graphs.rebound == 2 * int(Graph.rebinds), "a dropped graph's rebinding goes too"
    assert graphs.replay(routed(8)) is not None and graphs.replay(routed(2)) is not None
    assert graphs.replay(routed(1)) is None
    graphs.clear()
    assert len(graphs) == 0 and graphs.rebound == 0


def test_a_rebound_replay_reads_the_calls_own_tensors_and_writes_its_own_output(graphs):
    issue(graphs, routed(7, seed=1))  # bucket 8
    (graph,) = Graph.made
    fixed = [t.clone() for t in (*graph.staged.batch.__dict__.values(),) if t is not None]
    call = routed(6, seed=3)
    out = graphs.replay(call)
    assert torch.equal(out, compute(call)) and graph.replays == 1
    assert graphs.rebound == int(Graph.rebinds)
    if Graph.rebinds:
        tensors, rows = graph.bound
        assert rows == 6 and tensors[:4] == (call.batch.x, call.batch.x_sf, call.batch.topk_idx,
                                             call.batch.topk_weights)
        assert tensors[4] is out and out.untyped_storage().data_ptr() != graph.staged.out.untyped_storage().data_ptr()
        staged = [t for t in graph.staged.batch.__dict__.values() if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(staged, fixed, strict=True)), "nothing copied in"
    else:
        assert graph.bound is None


def test_hidden_batches_copy_and_only_routed_graphs_are_rebound(graphs):
    hidden = HiddenBatch(torch.randn(5, H).bfloat16(), torch.zeros(4, H, dtype=torch.bfloat16), None,
                         torch.zeros(1, dtype=torch.int32), 1)
    for call in (routed(5), Call(**{**routed(5).__dict__, "batch": hidden})):
        issue(graphs, call)
        assert torch.equal(graphs.replay(call), compute(call))
    assert len(graphs) == 2 and graphs.rebound == int(Graph.rebinds)


def test_a_graph_the_driver_will_not_point_at_a_call_leaves_its_kind_direct(graphs, caplog):
    issue(graphs, routed(7, seed=1))
    Rebinding.fail = True
    call = routed(6, seed=3)
    with caplog.at_level(logging.WARNING, logger="chunkring"):
        out = issue(graphs, call)
    assert torch.equal(out, compute(call))
    if Graph.rebinds:
        assert "could not be pointed at a call" in caplog.text and len(graphs) == graphs.rebound == 0
        assert len(graphs.schedule.direct) == 2, "run directly, and not captured again"
        issue(graphs, call)
        assert len(graphs.schedule.direct) == 3 and len(graphs) == 0
    else:
        assert len(graphs.schedule.direct) == 1, "a copying graph sets no parameters"
