"""Partition sizes are checked against the device's rules before any green context exists."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringUsageError
from chunkring.partition import plan_partition


def test_h200_default_split():
    plan = plan_partition(132, 8, 8, 16)
    assert (plan.producer_sms, plan.consumer_sms) == (16, 116)


@pytest.mark.parametrize("producer,needle", [(12, "multiple"), (0, "positive"), (128, "leaves the consumer 4"),
                                             (136, "leaves the consumer -4")])
def test_rejected_sizes(producer, needle):
    with pytest.raises(ChunkringUsageError, match=needle) as info:
        plan_partition(132, 8, 8, producer)
    assert info.value.field == "producer_sms"


@settings(max_examples=300, deadline=None)
@given(st.integers(8, 264), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([2, 4, 8]), st.integers(1, 300))
def test_any_accepted_plan_obeys_the_rules(total, min_partition, alignment, producer):
    try:
        plan = plan_partition(total, min_partition, alignment, producer)
    except ChunkringUsageError:
        assert producer % alignment or producer < min_partition or total - producer < min_partition
        return
    assert plan.producer_sms % alignment == 0 and plan.producer_sms >= min_partition
    assert plan.consumer_sms >= min_partition and plan.producer_sms + plan.consumer_sms == total


def test_one_hardware_queue_is_refused_before_any_gpu_work(monkeypatch):
    # Work-queue policy (runtime/partition.py): with a single connection the partitions share one
    # hardware queue, and a producer starved behind the consumer on the H200 even with the SM split.
    from chunkring import SmPartition

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ChunkringUsageError) as info:
        SmPartition(runtime=None, producer_sms=16)  # refused before the runtime is touched
    assert info.value.field == "CUDA_DEVICE_MAX_CONNECTIONS"
