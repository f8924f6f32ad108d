"""One hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1) serialises a producer behind a spinning
consumer: every object that spins on peers refuses it before any GPU work."""

import pytest

from chunkring import ChunkringUsageError, PayloadFormat, Ring, RingSpec
from chunkring.env import check_work_queues


def test_one_work_queue_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ChunkringUsageError) as info:
        check_work_queues()
    assert info.value.field == "CUDA_DEVICE_MAX_CONNECTIONS"
    spec = RingSpec(world_size=1, num_slots=2, tokens_per_slot=4, hidden=256, payload=PayloadFormat.FP8_E4M3,
                    topk=2, num_experts=4)

    class NoGpuRuntime:  # the check must come before anything touches the runtime's GPU
        world_size = 1

        def __getattr__(self, name):
            raise AssertionError(f"Ring touched runtime.{name} before refusing the work-queue setting")

    with pytest.raises(ChunkringUsageError) as info:
        Ring(NoGpuRuntime(), spec)
    assert info.value.field == "CUDA_DEVICE_MAX_CONNECTIONS"


@pytest.mark.parametrize("value", [None, "8", "32"])
def test_more_queues_pass(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    check_work_queues()
