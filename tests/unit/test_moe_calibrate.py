"""The streaming="auto" decision (chunkring.moe.calibrate): stream only where streamed stayed within the
tolerance of batch-ready at every measured count; one decision for every rank, from the rank where
streaming fared worst; bad calibration settings refused before any GPU work; an uncalibrated or
calibrated layer's "auto" calls take the mode the calibration says."""

from types import SimpleNamespace

import pytest

from chunkring import ChunkringUsageError, MoEConfig, RankInfo, StreamingCalibration
from chunkring.hostcomm import HostComm
from chunkring.moe.calibrate import _slowest_rank, calibrate
from chunkring.moe.calls import CallMode, check_run_args
from chunkring.moe.weights import quantize_weight_fp8
from tests.unit.test_host_validation_properties import layer_on_cpu


def test_streams_only_within_tolerance_everywhere():
    assert StreamingCalibration({16: (4.0, 4.1), 2048: (9.0, 9.2)}, 0.03).streams
    slow = StreamingCalibration({16: (4.0, 4.1), 2048: (9.0, 9.5)}, 0.03)
    assert not slow.streams
    assert "run batch-ready" in slow.describe() and "2048 tokens 1.056" in slow.describe()


def test_one_rank_keeps_its_own_figures():
    mine = {16: (1.0, 1.2)}
    assert _slowest_rank(HostComm(RankInfo(0, 1, 0, 1)), mine) == mine  # no MPI in a single process


def test_every_rank_takes_the_figures_of_the_rank_where_streaming_fared_worst():
    everyone = [{16: (1.0, 1.2), 2048: (9.0, 9.0)},   # rank 0: worst at 16 tokens
                {16: (2.0, 2.1), 2048: (8.0, 8.8)}]   # rank 1: worst at 2048
    for rank in (0, 1):
        runtime = SimpleNamespace(world_size=2, rank=rank, allgather_object=lambda mine: everyone)
        assert _slowest_rank(runtime, everyone[rank]) == {16: (1.0, 1.2), 2048: (8.0, 8.8)}


def layer(streaming=True):
    cfg = MoEConfig(num_experts=4, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=64,
                    **({"front_num_slots": 2, "front_tokens_per_slot": 16} if streaming else {}))
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
    import torch

    lay = layer()
    w13, w2 = (quantize_weight_fp8(torch.zeros(2, 256, 256)), quantize_weight_fp8(torch.zeros(2, 256, 128)))
    args = (torch.zeros(3, 256, dtype=torch.float8_e4m3fn), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32),
            torch.ones(3, 2), w13, w2)
    modes = []
    for calibration in (None, StreamingCalibration({16: (1.0, 1.01)}, 0.03),
                        StreamingCalibration({16: (1.0, 1.2)}, 0.03)):
        mode, _ = check_run_args(lay.config, 2, lay.runtime.torch_device, calibration, *args, streaming="auto",
                                 out=None, num_tokens=None, timeline=None)
        modes.append(mode)
    assert modes == [CallMode.BATCH_READY, CallMode.STREAMED, CallMode.BATCH_READY]


@pytest.mark.parametrize("max_tokens,chunk", [(8192, 512), (2048, 128), (4096, 256), (10, 1), (1, 1)])
def test_default_ring_is_two_slots_of_one_sixteenth(max_tokens, chunk):
    cfg = MoEConfig(num_experts=4, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=max_tokens)
    ringed = cfg.with_default_ring()
    assert (ringed.front_num_slots, ringed.front_tokens_per_slot) == (2, chunk)
    assert ringed.streaming and ringed.max_tokens_per_rank == max_tokens
    assert 2 * chunk * 8 <= max(max_tokens, 16)  # payload at most 1/8 of the full region (where it can be)
