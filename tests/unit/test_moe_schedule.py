"""Where a call's work runs (chunkring.moe._engine.schedule, docs/PROTOCOL.md "Progress" 9), on the host alone: a
streamed call of at most S chunks at this rank runs on the whole GPU's streams as a batch-ready call does; one of
more chunks runs its pull on the partition's consumer stream and its later chunks and drain on the partition's
producer stream; only a chunk past the ring's first S is published with ``may_wait`` (its producer may spin, so
its grid is the residency-sized one); with ``waves > 1`` the consumer stays on the partition whatever the count.
Streams, kernels and the expert work are recorders; the tensors are the CPU's."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

import chunkring.moe._engine.call
from chunkring.moe import CallMode
from chunkring.moe._engine.call import Call, RoutedBatch
from chunkring.moe._engine.experts import OwnRows
from chunkring.moe._engine.schedule import CallSchedule

N, H, K = 64, 8, 2
DECODE_TOKENS = 8  # the fake layer's decode_for: the decode path for calls of at most this many tokens


class Stream:
    def __init__(self, name, launched=None):
        self.name, self.waits, self.launched = name, [], launched

    def wait_stream(self, other):
        self.waits.append(other.name)
        if self.launched is not None:
            self.launched.append(("wait", f"{self.name}<-{other.name}"))


class Device:
    """torch.cuda's current stream, as the schedule switches it."""

    def __init__(self, caller):
        self.current = caller

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


class Compute:
    """ExpertCompute as the schedule uses it: the expert work (a call) and the waves, recorded where they run."""

    pushed, push_blocks = torch.zeros(1, dtype=torch.int32), 1

    def __init__(self, launched, device):
        self.launched, self.device = launched, device
        self.engines = []  # each expert call's decode= (the engine it was asked for)

    def warm_up(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        self.launched.append(("experts", self.device.current.name))
        self.engines.append(kwargs["decode"])
        self.empty = kwargs["empty"]
        return "own rows"

    def empty_plan(self):
        self.launched.append(("empty_plan", self.device.current.name))
        return "empty plan"

    experts_per_rank = 4

    def plan_buffers(self, stage):
        self.launched.append(("plan_buffers", self.device.current.name))
        self.stage = stage
        rows = torch.zeros(8, dtype=torch.int32)
        plan = SimpleNamespace(counts="counts", group_end="group end", src=rows, token="token", k="k", weight="weight",
                               rows="rows", rows_sf="rows sf", own_row="own row")
        return plan

    def plan(self, stage, empty):
        self.launched.append(("plan", self.device.current.name))
        self.empty = empty
        return SimpleNamespace(own_row="own row")

    def experts(self, plan, w13, w2, *, decode):
        self.launched.append(("experts", self.device.current.name))
        self.engines.append(decode)
        return "expert rows"

    def reduce(self, combine, routing, weights, out, own, *, desc):
        self.launched.append(("reduce", self.device.current.name))
        self.routing, self.weights, self.own, self.reduce_desc = routing, weights, own, desc

    def wave(self, *args, **kwargs):
        self.launched.append(("wave", self.device.current.name))
        self.engines.append(kwargs["decode"])


def schedule_on(monkeypatch, *, slots, waves=1, partition=True):
    caller = Stream("caller")
    device = Device(caller)
    monkeypatch.setattr(torch.cuda, "stream", device.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: device.current)
    launched = []

    def launch(name, **kwargs):
        launched.append((name, kwargs["stream"].name))

    whole = (Stream("whole.producer"), Stream("whole.consumer", launched))
    streamed = (Stream("part.producer"), Stream("part.consumer")) if partition else whole
    spec = SimpleNamespace(tokens_per_slot=16, num_slots=slots, world_size=1)
    rings = {mode: SimpleNamespace(spec=spec, desc=mode.value) for mode in CallMode}
    pool = SimpleNamespace(reset=lambda: None, desc="pool") if waves > 1 else None
    res = SimpleNamespace(
        config=SimpleNamespace(topk=K, hidden=H, waves=waves), rings=rings, pool=pool, pull_grid=4,
        runtime=SimpleNamespace(torch_device="cpu", rank=0, host_barrier=lambda **kw: None,
                                abandon_barrier=lambda: None),
        streams={CallMode.BATCH_READY: whole, CallMode.STREAMED: streamed},
        compute_streams={CallMode.BATCH_READY: whole[1],
                         CallMode.STREAMED: Stream("whole.compute", launched) if partition else whole[1]},
        consumer_sms={CallMode.BATCH_READY: None, CallMode.STREAMED: 12 if partition else None},
        pull_stream=Stream("part.side") if waves > 1 else None,
        combine=torch.zeros(N * K, H, dtype=torch.bfloat16), peer_combine=None,
        produce_arrivals={mode: torch.zeros(1, dtype=torch.int32) for mode in CallMode},
        arrivals={mode: torch.zeros(1, 4, dtype=torch.int32) for mode in CallMode},
        stage=SimpleNamespace(idx=torch.zeros(1, N, K, dtype=torch.int32), w=torch.zeros(1, N, K),
                              held=torch.zeros(1, dtype=torch.int64), desc="stage"),
        kernels=SimpleNamespace(stream=SimpleNamespace(launch=launch)),
        decode_for=lambda n: n <= DECODE_TOKENS)
    res.compute = Compute(launched, device)
    return CallSchedule(res), res, launched


def call(schedule, mode, n, chunk=None):
    """One call of ``n`` rows through the schedule, resolved as the layer resolves it (the engine by its size); the
    chunks its batch published: (start, end, stream, may_wait)."""
    published = []

    def publish(ring, start, end, eos, valid, rows, stream, may_wait):
        published.append((start, end, stream.name, may_wait))

    schedule.enqueue(Call(mode, SimpleNamespace(publish=publish), n, chunk, None, None, None, None, None,
                          schedule.res.decode_for(n)))
    return published


def where(launched, name):
    return {stream for kernel, stream in launched if kernel == name}


@pytest.mark.parametrize("n", [0, 1, 16, 32])
def test_a_streamed_call_that_fits_the_ring_runs_on_the_whole_gpu_as_batch_ready_does(monkeypatch, n):
    schedule, res, launched = schedule_on(monkeypatch, slots=2)
    published = call(schedule, CallMode.STREAMED, n)
    assert all(stream == "whole.producer" and not may_wait for _, _, stream, may_wait in published)
    assert where(launched, "moe_pull") == {"whole.consumer"} and where(launched, "experts") == {"whole.consumer"}
    assert where(launched, "moe_drain") == where(launched, "reduce") == {"whole.producer"}
    batch_schedule, _, batch_launched = schedule_on(monkeypatch, slots=2)
    call(batch_schedule, CallMode.BATCH_READY, n)
    assert [s for _, s in launched] == [s for _, s in batch_launched]  # the same placement, kernel by kernel


def test_a_streamed_call_of_more_chunks_than_slots_spins_on_the_partition(monkeypatch):
    schedule, res, launched = schedule_on(monkeypatch, slots=2)
    published = call(schedule, CallMode.STREAMED, 61)  # four chunks of 16 through two slots
    assert [(s, e) for s, e, _, _ in published] == [(0, 16), (16, 32), (32, 48), (48, 61)]
    assert [(stream, may_wait) for _, _, stream, may_wait in published] == [
        ("whole.producer", False), ("whole.producer", False), ("part.producer", True), ("part.producer", True)]
    assert where(launched, "moe_pull") == {"part.consumer"}
    assert where(launched, "experts") == {"whole.compute"}  # after the pull, over the whole GPU
    assert where(launched, "moe_drain") == {"part.producer"}
    assert where(launched, "reduce") == {"part.producer"}  # after the drain, on its stream
    assert "part.consumer" in res.compute_streams[CallMode.STREAMED].waits


def test_waves_keep_the_consumer_on_the_partition_whatever_the_count(monkeypatch):
    schedule, res, launched = schedule_on(monkeypatch, slots=2, waves=2)
    call(schedule, CallMode.STREAMED, 1)
    assert where(launched, "moe_pull_blocks") == {"part.side"} and where(launched, "wave") == {"part.consumer"}
    assert where(launched, "moe_ack_held") == {"part.consumer"}


@pytest.mark.parametrize("waves", [1, 2])
def test_each_call_asks_for_the_engine_its_size_takes_in_either_mode(monkeypatch, waves):
    """decode="auto" per call: the expert work of a call (every wave's) runs on the engine
    ``LayerResources.decode_for`` names for the call's token count, streamed as batch-ready."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2, waves=waves)
    for n in (1, DECODE_TOKENS, DECODE_TOKENS + 1, N):
        for mode in CallMode:
            res.compute.engines.clear()
            call(schedule, mode, n)
            want = n <= DECODE_TOKENS
            assert res.compute.engines and all(engine is want for engine in res.compute.engines), (n, mode)


@pytest.mark.parametrize("mode", list(CallMode))
def test_the_reduction_reads_this_ranks_own_routing_and_nothing_clears_the_combine_rows(monkeypatch, mode):
    """The owner's reduction adds only its routed choices' rows (docs/PROTOCOL.md, "The MoE layer on the ring"):
    it takes this rank's own stage rows - the routing its pull checked - and no step of the call writes the
    combine buffer at this rank (only peers' pushes do), at any chunking."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2)
    res.runtime.rank = 1
    res.stage.idx = torch.arange(2 * N * K, dtype=torch.int32).view(2, N, K)
    res.stage.w = torch.rand(2, N, K)
    res.combine.fill_(float("nan"))
    for n in (0, 1, 61):
        call(schedule, mode, n)
        routing, weights = res.compute.routing, res.compute.weights
        assert routing.data_ptr() == res.stage.idx[1].data_ptr() and routing.shape == (N, K)
        assert weights.data_ptr() == res.stage.w[1].data_ptr() and weights.shape == (N, K)
        assert res.compute.reduce_desc is res.rings[mode].desc  # zeros where the call's ring recorded an error
    assert res.combine.isnan().all()


@pytest.mark.parametrize(("mode", "waves"), [(CallMode.BATCH_READY, 1), (CallMode.STREAMED, 1), (CallMode.STREAMED, 2)])
def test_the_batch_plans_own_rows_reach_the_reduction_and_outlive_it(monkeypatch, mode, waves):
    """This rank's own choices stay where its experts wrote them (docs/PROTOCOL.md, "The MoE layer on the ring"):
    the batch plan's own rows go to the reduction, and the stream that allocated them waits for the reduction
    before the call returns (so nothing there reuses their memory before it read them). Waves push every row:
    the reduction gets none."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2, waves=waves)
    call(schedule, mode, 61)
    if waves > 1:
        assert res.compute.own is None
        return
    assert res.compute.own == "own rows"
    compute = res.compute_streams[mode] if mode is CallMode.STREAMED else res.streams[mode][1]
    producer = res.streams[mode][0].name
    names = [(name, where) for name, where in launched]
    assert names.index(("wait", f"{compute.name}<-{producer}")) > names.index(("reduce", producer))


@pytest.mark.parametrize("waves", [1, 2])
def test_one_reset_launch_precedes_the_pull_on_the_consumer_stream(monkeypatch, waves):
    """The stage's routing and held seqs and the push count are reset by one moe_call_reset
    on the consumer stream, before the pull (the waves' pull stream waits for the consumer stream)."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2, waves=waves)
    call(schedule, CallMode.STREAMED, 61)
    names = [name for name, _ in launched]
    pull = "moe_pull_blocks" if waves > 1 else "moe_pull"
    assert names.count("moe_call_reset") == 1 and names.index("moe_call_reset") < names.index(pull)
    assert where(launched, "moe_call_reset") == {"part.consumer"}


@pytest.mark.parametrize(("mode", "n"), [(CallMode.BATCH_READY, 61), (CallMode.STREAMED, 16), (CallMode.STREAMED, 61)])
def test_the_batch_plan_is_reset_before_the_pull_on_the_stream_that_uses_it(monkeypatch, mode, n):
    """The plan's reset depends on nothing of the call: enqueued before the pull (which waits for the chunks), on
    the stream the expert work runs on, which joins the call's start first; the experts fill that plan."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2)
    call(schedule, mode, n)
    names = [name for name, _ in launched]
    assert names.index("empty_plan") < names.index("moe_pull")
    assert where(launched, "empty_plan") == where(launched, "experts") and res.compute.empty == "empty plan"
    compute = res.compute_streams[CallMode.STREAMED]
    if where(launched, "experts") == {compute.name}:  # a stream of its own: it waited for the consumer twice
        assert compute.waits[:2] == ["part.consumer", "part.consumer"]


@pytest.mark.parametrize("waves", [1, 2])
def test_nothing_that_waits_for_the_pull_is_enqueued_before_the_chunks_the_pull_waits_for(monkeypatch, waves):
    """Streams share the GPU's hardware queues, which run commands in the order the host enqueued them
    (docs/PROTOCOL.md, "Progress" 10): a wait for the pull's end enqueued ahead of a later chunk would hold that
    chunk's publish behind a pull that needs it. So the later chunks (published with ``may_wait``) come after the
    pull, whose acks they wait for, and before the expert work (the second wait for the consumer stream, or the
    waves, whose claims wait for pulled rows), the held acks and the drain."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2, waves=waves)

    def publish(ring, start, end, eos, valid, rows, stream, may_wait):
        launched.append(("publish_waits" if may_wait else "publish", stream.name))

    schedule.enqueue(Call(CallMode.STREAMED, SimpleNamespace(publish=publish), 61, None, None, None, None, None, None,
                          False))
    names = [name for name, _ in launched]
    pull = "moe_pull_blocks" if waves > 1 else "moe_pull"
    later = [i for i, name in enumerate(names) if name == "publish_waits"]
    assert len(later) == 2 and names.index(pull) < later[0]
    after_pull = [i for i, name in enumerate(names) if name in ("experts", "wave", "moe_ack_held", "moe_drain")]
    if waves == 1:  # the compute stream's second wait for the consumer stream: the pull's end
        waits = [i for i, entry in enumerate(launched) if entry == ("wait", "whole.compute<-part.consumer")]
        assert len(waits) == 2 and waits[0] < names.index(pull)
        after_pull.append(waits[1])
    assert after_pull and min(after_pull) > later[-1]


def routed_call(schedule, mode, n):
    """A call of ``n`` routed rows (a :class:`RoutedBatch`, CPU tensors) through the schedule."""
    batch = RoutedBatch(torch.zeros(n, H, dtype=torch.float8_e4m3fn), torch.ones(n, 1),
                        torch.zeros(n, K, dtype=torch.int32), torch.ones(n, K))
    schedule.enqueue(Call(mode, batch, n, None, None, None, None, None, None, schedule.res.decode_for(n)))


@pytest.mark.parametrize("n", [0, 1, 61])
def test_a_one_rank_batch_ready_call_of_routed_rows_plans_them_itself_on_the_consumer_stream(monkeypatch, n):
    """docs/PROTOCOL.md, "One rank": no reset, publish, pull, acknowledgement or drain - the plan's buffers,
    moe_local_route, moe_local_scatter (a dependent launch), the experts (on the engine the call's size takes) and the
    reduction, in that order, all on the whole GPU's consumer stream, which joins the caller first and which the
    caller joins last; the reduction reads the plan's own rows where the experts left them, and the ring's descriptor
    (zeros after an error)."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2)
    caller = torch.cuda.current_stream()
    routed_call(schedule, CallMode.BATCH_READY, n)
    work = [(name, stream) for name, stream in launched if name != "wait"]
    assert [name for name, _ in work] == ["plan_buffers", "moe_local_route", "moe_local_scatter", "experts",
                                          "reduce"]
    assert {stream for _, stream in work} == {"whole.consumer"}
    assert res.streams[CallMode.BATCH_READY][1].waits == ["caller"] and caller.waits == ["whole.consumer"]
    assert res.compute.stage is res.stage and res.compute.engines == [n <= DECODE_TOKENS]
    assert res.compute.own == OwnRows("own row", "expert rows")
    assert res.compute.reduce_desc is res.rings[CallMode.BATCH_READY].desc


@pytest.mark.parametrize(("mode", "ranks"), [(CallMode.STREAMED, 1), (CallMode.BATCH_READY, 2)])
def test_streamed_calls_and_calls_of_several_ranks_keep_the_ring(monkeypatch, mode, ranks):
    """Only a one-rank batch-ready call of routed rows skips the ring: a streamed call of a one-rank layer publishes
    and pulls (its chunks, its partition), and so does a batch-ready call at two ranks."""
    schedule, res, launched = schedule_on(monkeypatch, slots=2)
    monkeypatch.setattr(chunkring.moe._engine.call, "enqueue_publish",
                        lambda *args: launched.append(("publish", args[-1].name)))
    for ring in res.rings.values():
        ring.spec.world_size = ranks
    routed_call(schedule, mode, 61)
    names = [name for name, _ in launched]
    assert not {"moe_local_route", "moe_local_scatter"} & set(names)
    assert {"publish", "moe_pull", "moe_ack_held", "moe_drain"} <= set(names)
