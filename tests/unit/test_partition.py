"""Partition sizes are checked against the device's rules before any green context exists."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.partition import (
    DEFAULT_PARTITION,
    NO_PARTITION,
    check_partition_arg,
    default_producer_sms,
    plan_partition,
)


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
    # Work-queue policy (runtime/chunkring/partition.py): with a single connection the partitions share one
    # hardware queue, and a producer starved behind the consumer on the H200 even with the SM split.
    from chunkring import SmPartition

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ChunkringUsageError) as info:
        SmPartition(runtime=None, producer_sms=16)  # refused before the runtime is touched
    assert info.value.field == "CUDA_DEVICE_MAX_CONNECTIONS"


# The default partition's size (chunkring.partition.default_producer_sms): a quarter of the SMs, from the
# H200 measurements PRODUCER_SM_SHARE cites, within what the device's rules and the consumer's grid allow.

def test_default_on_the_h200_is_a_quarter_of_the_sms():
    # The H200: 132 SMs, green-context partitions of at least 8 SMs aligned to 8; the layer's 16-block pull.
    assert default_producer_sms(132, 8, 8, consumer_grid=16, consumer_blocks_per_sm=8) == 32
    assert plan_partition(132, 8, 8, 32).consumer_sms == 100


def test_a_pull_only_consumer_keeps_the_fewest_sms_that_hold_its_grid():
    # share=None (one wave: only the pull spins on the consumer's SMs): the producers take the rest, aligned.
    assert default_producer_sms(132, 8, 8, consumer_grid=16, consumer_blocks_per_sm=8, share=None) == 120
    assert default_producer_sms(132, 8, 8, consumer_grid=16, consumer_blocks_per_sm=1, share=None) == 112
    assert plan_partition(132, 8, 8, 112).consumer_sms == 20
    with pytest.raises(ChunkringUsageError, match='partition="none"'):
        default_producer_sms(15, 8, 8, consumer_grid=16, consumer_blocks_per_sm=8, share=None)


@settings(max_examples=300, deadline=None)
@given(st.integers(8, 264), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([2, 4, 8]), st.integers(1, 64),
       st.sampled_from([1, 2, 8]))
def test_a_pull_only_split_is_a_valid_plan_that_keeps_the_grid_resident(total, min_partition, alignment, grid,
                                                                          per_sm):
    try:
        producer = default_producer_sms(total, min_partition, alignment, grid, per_sm, share=None)
    except ChunkringUsageError:
        return
    plan = plan_partition(total, min_partition, alignment, producer)
    assert plan.consumer_sms * per_sm >= grid and plan.consumer_sms < max(min_partition, -(-grid // per_sm)) + alignment


def test_default_shrinks_to_keep_the_consumer_grid_resident():
    # A consumer of 120 blocks at 1 per SM needs 120 SMs: the producers get the 8 left after alignment.
    assert default_producer_sms(132, 8, 8, consumer_grid=120, consumer_blocks_per_sm=1) == 8
    # An MPS share of 24 SMs: a quarter rounds to 8, the consumer keeps 16.
    assert default_producer_sms(24, 8, 8, consumer_grid=16, consumer_blocks_per_sm=8) == 8


@pytest.mark.parametrize("total,grid,per_sm", [(15, 16, 8), (132, 130, 1), (8, 1, 1)])
def test_default_refuses_a_gpu_too_small_to_split(total, grid, per_sm):
    with pytest.raises(ChunkringUsageError, match='partition="none"') as info:
        default_producer_sms(total, 8, 8, consumer_grid=grid, consumer_blocks_per_sm=per_sm)
    assert info.value.field == "partition"


@pytest.mark.parametrize("name,kwargs", [("total_sms", {"total_sms": 0}), ("consumer_grid", {"consumer_grid": 1.5}),
                                         ("consumer_blocks_per_sm", {"consumer_blocks_per_sm": True}),
                                         ("share", {"share": 1.0}), ("share", {"share": 0})])
def test_default_refuses_bad_inputs(name, kwargs):
    args = {"total_sms": 132, "min_partition": 8, "alignment": 8, "consumer_grid": 16, "consumer_blocks_per_sm": 8,
            **kwargs}
    with pytest.raises(ChunkringUsageError) as info:
        default_producer_sms(**args)
    assert info.value.field == name


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 300),
       st.integers(1, 16), st.floats(0.01, 0.99))
def test_any_default_is_a_valid_plan_that_holds_the_consumer_grid(total, min_partition, alignment, grid, per_sm,
                                                                   share):
    try:
        producer = default_producer_sms(total, min_partition, alignment, grid, per_sm, share)
    except ChunkringUsageError:
        # Refused only where even the smallest aligned producer partition leaves the consumer too little.
        lowest = -(-min_partition // alignment) * alignment
        assert total - lowest < max(min_partition, -(-grid // per_sm))
        return
    plan = plan_partition(total, min_partition, alignment, producer)  # the device's rules hold
    assert plan.consumer_sms * per_sm >= grid


@pytest.mark.parametrize("value", [None, "", "AUTO", 16, True, object()])
def test_partition_argument_other_than_a_partition_auto_or_none_is_refused(value):
    with pytest.raises(ChunkringUsageError, match="auto") as info:
        check_partition_arg(value)
    assert info.value.field == "partition"
    # The layer refuses it before touching the runtime (None is not a runtime).
    from chunkring import MoEConfig, MoELayer

    cfg = MoEConfig(num_experts=4, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=64)
    with pytest.raises(ChunkringUsageError) as layer_info:
        MoELayer(None, cfg, partition=value)
    assert layer_info.value.field == "partition"


@pytest.mark.parametrize("value", [DEFAULT_PARTITION, NO_PARTITION])
def test_partition_argument_auto_and_none_are_accepted(value):
    assert check_partition_arg(value) == value


class _FakeSm:
    """cuda.core's SMResource as SmPartition reads it: 132 SMs, partitions of 8 aligned to 8."""

    sm_count, min_partition_size, coscheduled_alignment = 132, 8, 8

    def __init__(self, count=132):
        self.sm_count = count

    def split(self, options):
        return [_FakeSm(options.count)], _FakeSm(self.sm_count - options.count)


class _FakeHandle:
    """A cuda.core green context or stream: records itself in ``made`` and whether it is still open."""

    handle = 0

    def __init__(self, made):
        self.made, self.open = made, True
        made.append(self)

    def create_stream(self):
        return _FakeHandle(self.made)

    def sync(self):
        pass

    def close(self):
        self.open = False


class _FakeRuntime:
    """What SmPartition reads of a Runtime; ``close()`` runs what ``at_close`` registered, as Runtime.close does.
    ``made``: every green context and stream made on it."""

    torch_device = "cuda:0"

    def __init__(self):
        import types

        self.releases, self.made = [], []
        self.device = types.SimpleNamespace(resources=types.SimpleNamespace(sm=_FakeSm()), set_current=lambda: None,
                                            create_context=lambda options: _FakeHandle(self.made))

    def at_close(self, release):
        self.releases.append(release)

    def close(self):
        for release in reversed(self.releases):
            release()


def _fake_runtime(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: object())
    runtime = _FakeRuntime()
    return runtime, runtime.made


def test_layers_share_the_runtimes_partition_of_a_size_and_only_the_runtime_destroys_it(monkeypatch):
    from chunkring import SmPartition

    runtime, made = _fake_runtime(monkeypatch)
    first = SmPartition.shared(runtime, 16, 8, share=None)
    assert len(made) == 5  # two green contexts, three streams
    assert SmPartition.shared(runtime, 16, 8, share=None) is first and len(made) == 5  # none made again
    quarter = SmPartition.shared(runtime, 16, 8)  # another size: its own
    assert quarter is not first and quarter.plan.producer_sms == 32 and len(made) == 10
    assert len(runtime.releases) == 1  # one release for all of this runtime's partitions
    with pytest.raises(ChunkringUsageError, match="Runtime.close") as info:
        first.close()
    assert info.value.field == "partition" and all(handle.open for handle in made)
    runtime.close()
    assert first.closed and quarter.closed and not any(handle.open for handle in made)
    other, _ = _fake_runtime(monkeypatch)
    assert SmPartition.shared(other, 16, 8, share=None) is not first  # per runtime


def test_a_callers_partition_is_its_own_to_close(monkeypatch):
    from chunkring import SmPartition

    runtime, made = _fake_runtime(monkeypatch)
    with SmPartition(runtime, 16) as part:
        assert not part.closed and not runtime.releases
    assert part.closed and not any(handle.open for handle in made)


def test_a_closed_partition_or_another_runtimes_is_refused(monkeypatch):
    from chunkring import MoEConfig, MoELayer, SmPartition

    runtime, _ = _fake_runtime(monkeypatch)
    cfg = MoEConfig(num_experts=4, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=64)
    part = SmPartition(runtime, 16)
    other, _ = _fake_runtime(monkeypatch)
    with pytest.raises(ChunkringUsageError, match="another runtime") as info:
        MoELayer(other, cfg, partition=part)
    assert info.value.field == "partition"
    part.close()
    with pytest.raises(ChunkringUsageError, match="closed") as info:
        check_partition_arg(part)
    assert info.value.field == "partition"


def test_teardown_closes_every_handle_when_one_fails_and_says_so(monkeypatch):
    from chunkring import SmPartition

    runtime, made = _fake_runtime(monkeypatch)
    part = SmPartition.shared(runtime, 16, 8, share=None)
    producer_stream = made[1]  # made in order: a green context, its stream, the other context, its two streams

    def faulted():
        raise RuntimeError("cudaErrorLaunchFailure")

    monkeypatch.setattr(producer_stream, "sync", faulted)
    with pytest.raises(ChunkringRuntimeError, match="cudaErrorLaunchFailure"):
        runtime.close()
    assert part.closed and not any(handle.open for handle in made)


def test_a_failed_construction_closes_what_it_made(monkeypatch):
    from chunkring import SmPartition

    runtime, made = _fake_runtime(monkeypatch)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(ChunkringRuntimeError, match="could not create"):
        SmPartition(runtime, 16)
    assert len(made) == 5 and not any(h.open for h in made)
