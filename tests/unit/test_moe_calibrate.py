"""The streaming="auto" decision (chunkring.moe.calibration, measured by chunkring.moe.calibration): stream only where
some chunking streamed within the tolerance of batch-ready at every measured count; each call chunked as the
count governing its size measured fastest; one decision for every rank, from each option's slowest rank; bad
calibration settings refused before any GPU work; an uncalibrated or calibrated layer's "auto" calls take
the mode, and streamed calls the chunk size, the calibration says."""

from types import SimpleNamespace

import pytest
import torch

from chunkring import ChunkringUsageError, MoEConfig, StreamingCalibration
from chunkring.moe._engine.call import CallMode, call_chunk, resolve_mode
from chunkring.moe.calibration import calibrate, chunk_candidates, slowest_rank


def test_streams_only_where_some_chunking_kept_up_everywhere():
    fast = StreamingCalibration({16: 4.0, 2048: 9.0}, {16: {16: 4.02}, 2048: {256: 9.5, 1024: 8.5}})
    assert fast.streams and fast.chunk_for(2048) == 1024 and fast.chunk_for(3000) == 1024
    slow = StreamingCalibration({16: 4.0, 2048: 9.0}, {16: {16: 4.1}, 2048: {256: 9.5, 1024: 8.5}})
    assert not slow.streams  # 2.5 % slower at 16 tokens, beyond the 1 % tolerance
    assert "run batch-ready" in slow.describe() and "16 tokens 1.025 (chunks of 16)" in slow.describe()


def test_a_call_is_governed_by_the_smallest_calibrated_count_at_or_above_it():
    cal = StreamingCalibration({128: 1.0, 1024: 2.0, 8192: 9.0},
                               {128: {128: 1.0}, 1024: {512: 1.9, 1024: 2.0}, 8192: {2048: 8.0, 4096: 8.5}})
    assert [cal.governing_count(n) for n in (1, 128, 129, 1024, 5000, 9000)] == [128, 128, 1024, 1024, 8192, 8192]
    assert [cal.chunk_for(n) for n in (100, 1000, 6000)] == [128, 512, 2048]


def test_figures_must_cover_the_same_counts():
    with pytest.raises(ChunkringUsageError):
        StreamingCalibration({16: 1.0}, {32: {16: 1.0}})
    with pytest.raises(ChunkringUsageError):
        StreamingCalibration({16: 1.0}, {16: {}})


@pytest.mark.parametrize(("batch", "streamed", "tolerance", "field"), [
    ({16: 1.0}, {16: {0: 1.0}}, 0.01, "streamed_ms"),       # a chunk of 0: range() fails inside the schedule
    ({16: 1.0}, {16: {-8: 1.0}}, 0.01, "streamed_ms"),      # a negative chunk: nothing would be published
    ({16: 1.0}, {16: {"8": 1.0}}, 0.01, "streamed_ms"),     # keys as JSON leaves them
    ({"16": 1.0}, {"16": {8: 1.0}}, 0.01, "batch_ms"),
    ({16: float("nan")}, {16: {8: 1.0}}, 0.01, "batch_ms"),
    ({16: 1.0}, {16: {8: 0.0}}, 0.01, "streamed_ms"),
    ({16: 1.0}, {16: [1.0]}, 0.01, "streamed_ms"),
    ({16: 1.0}, {16: {8: 1.0}}, 1.5, "tolerance"),
    ({16: 1.0}, {16: {8: 1.0}}, True, "tolerance"),
])
def test_figures_a_call_could_not_follow_are_refused(batch, streamed, tolerance, field):
    with pytest.raises(ChunkringUsageError) as info:
        StreamingCalibration(batch, streamed, tolerance)
    assert info.value.field == field


def test_each_option_takes_its_slowest_ranks_figure():
    everyone = [({16: 1.0, 2048: 9.0}, {16: {16: 1.2}, 2048: {512: 9.0}}),   # rank 0: slow streaming at 16
                ({16: 2.0, 2048: 8.0}, {16: {16: 2.1}, 2048: {512: 9.9}})]   # rank 1: slow at 2048
    assert slowest_rank(everyone) == ({16: 2.0, 2048: 9.0}, {16: {16: 2.1}, 2048: {512: 9.9}})
    assert slowest_rank(everyone[:1]) == everyone[0]


def test_chunk_candidates_end_with_the_largest_chunk_that_fits():
    assert chunk_candidates(4096, 1024) == (64, 128, 256, 512, 1024)
    assert chunk_candidates(100, 1024) == (64, 100)
    assert chunk_candidates(8, 512) == (8,)
    assert chunk_candidates(3000, 2048, [512, 4096, 1024]) == (512, 1024, 2048)


def layer_on_cpu(config: MoEConfig, world: int = 2) -> SimpleNamespace:
    """What a MoELayer's host-side checks read of it, on a CPU stand-in runtime."""
    return SimpleNamespace(runtime=SimpleNamespace(torch_device=torch.device("cpu"), world_size=world, rank=0),
                           config=config, experts_per_rank=config.num_experts // world, first_expert=0,
                           streaming_calibration=None)


def layer(streaming=True):
    cfg = MoEConfig(num_experts=4, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=64,
                    **({"stream_slots": 2, "stream_slot_tokens": 16} if streaming else {}))
    return layer_on_cpu(cfg)


@pytest.mark.parametrize("kwargs,field", [
    (dict(token_counts=[]), "token_counts"),
    (dict(token_counts=[0]), "token_counts"),
    (dict(token_counts=[65]), "token_counts"),
    (dict(token_counts=[True]), "token_counts"),
    (dict(token_counts=[16], iterations=0), "iterations"),
    (dict(token_counts=[16], warmup=-1), "warmup"),
    (dict(token_counts=[16], tolerance=1.5), "tolerance"),
    (dict(token_counts=[16], tolerance=True), "tolerance"),
])
def test_bad_settings_are_refused_before_gpu_work(kwargs, field):
    with pytest.raises(ChunkringUsageError) as info:
        calibrate(layer(), None, None, None, **kwargs)
    assert info.value.field == field


def test_a_layer_without_a_streaming_ring_cannot_calibrate():
    with pytest.raises(ChunkringUsageError) as info:
        calibrate(layer(streaming=False), None, None, None, [16])
    assert info.value.field == "config"


def test_auto_calls_follow_the_calibration():
    lay = layer()
    modes = [resolve_mode(lay.config, calibration, "auto")
             for calibration in (None, StreamingCalibration({16: 1.0}, {16: {16: 1.01}}, 0.03),
                                 StreamingCalibration({16: 1.0}, {16: {16: 1.2}}, 0.03))]
    assert modes == [CallMode.BATCH_READY, CallMode.STREAMED, CallMode.BATCH_READY]


def test_a_streamed_calls_chunk_is_given_calibrated_or_the_slot():
    cfg = layer().config  # slots of 16 tokens
    cal = StreamingCalibration({8: 1.0, 64: 2.0}, {8: {8: 1.0}, 64: {8: 1.5, 16: 1.8}})
    assert call_chunk(cfg, None, CallMode.STREAMED, 40, None) == 16
    assert call_chunk(cfg, cal, CallMode.STREAMED, 40, None) == 8
    assert call_chunk(cfg, cal, CallMode.STREAMED, 40, 12) == 12
    assert call_chunk(cfg, cal, CallMode.BATCH_READY, 40, None) is None
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ChunkringUsageError) as info:
            call_chunk(cfg, None, CallMode.STREAMED, 40, bad)
        assert info.value.field == "chunk"


@pytest.mark.parametrize("max_tokens,chunk", [(8192, 2048), (2048, 512), (4096, 1024), (10, 2), (1, 1)])
def test_default_ring_is_two_slots_of_a_quarter(max_tokens, chunk):
    cfg = MoEConfig(num_experts=4, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=max_tokens)
    ringed = cfg.with_default_ring()
    assert (ringed.stream_slots, ringed.stream_slot_tokens) == (2, chunk)
    assert ringed.streaming and ringed.max_tokens_per_rank == max_tokens
    assert 2 * chunk * 2 <= max(max_tokens, 4)  # payload at most half the full region (where it can be)


def test_a_sample_covers_about_burst_tokens_and_every_rank_agrees():
    from chunkring.moe.calibration import BURST_TOKENS, MAX_BURST, burst_for

    assert [burst_for(n) for n in (0, 1, 128, 1024, 2048, 8192)] == [MAX_BURST, MAX_BURST, 16, 2, 1, 1]
    for n in range(1, 5000):  # the most replays within BURST_TOKENS, at least one, at most MAX_BURST
        burst = burst_for(n)
        assert 1 <= burst <= MAX_BURST and (burst == 1 or burst * n <= BURST_TOKENS)
        assert burst == MAX_BURST or (burst + 1) * n > BURST_TOKENS


class _Clock:
    """A fake device: each graph replay advances time by its call's cost; events read the time."""

    def __init__(self):
        self.now, self.order = 0.0, []

    def event(self, enable_timing):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.at - self.at

        return Event()


def test_interleaved_bursts_time_each_call_per_replay_and_rotate_the_order(monkeypatch):
    from chunkring.moe import calibration

    clock = _Clock()
    cost = {"a": 1.0, "b": 3.0, "c": 2.0}
    # Per replay, by round (4 replays a sample, 3 calls a round): a warm-up round far off (not counted), then
    # rounds off by +8, 0 and +2 per replay: each call's samples are cost + 8, cost, cost + 2 - whose median
    # is cost + 2, not the minimum, the maximum, the first or the last sample.
    drift = iter([100.0] * 12 + [8.0] * 12 + [0.0] * 12 + [2.0] * 12)

    def capture(call, load=None):
        key = call()
        return SimpleNamespace(replay=lambda: (clock.order.append(key), setattr(clock, "now", clock.now + cost[key]
                                                                                + next(drift))))

    monkeypatch.setattr(calibration, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    barriers = []
    got = calibration.replay_medians_ms({k: (lambda k=k: k) for k in cost}, iterations=3, warmup=1, burst=4,
                                        barrier=lambda: barriers.append(1))
    assert got == {key: ms + 2.0 for key, ms in cost.items()}  # the median sample: a burst's span over its replays
    assert len(clock.order) == 4 * 3 * 4 and len(barriers) == 4 * 3  # (warm-up + timed rounds) x calls x burst
    rounds = [clock.order[i:i + 12:4] for i in range(0, len(clock.order), 12)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]  # each first in turn
    with pytest.raises(ChunkringUsageError) as info:
        calibration.replay_medians_ms({"a": lambda: "a"}, iterations=1, warmup=0, burst=0)
    assert info.value.field == "burst"


def test_every_graph_is_released_before_the_pools_go_back(monkeypatch):
    """empty_cache returns only the pools of graphs nothing references: none may outlive the timing."""
    import weakref

    from chunkring.moe import calibration

    class Graph:
        def replay(self):
            pass

    alive = weakref.WeakSet()

    def capture(call, load=None):
        graph = Graph()
        alive.add(graph)
        return graph

    seen_at_release = []
    monkeypatch.setattr(calibration, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "Event", _Clock().event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen_at_release.append(len(alive)))
    calibration.replay_medians_ms({"a": lambda: None, "b": lambda: None}, iterations=2, warmup=1)
    assert seen_at_release == [0]
