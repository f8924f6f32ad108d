"""SM partitions: confine the persistent consumer so the producers it waits for always have SMs.

Measured on the H200 (docs/PROTOCOL.md, "Progress"): a consumer grid that fills the GPU and spins
starves its producers, even when the producers sit in their own green context; confining the *consumer*
to a green context that leaves SMs free is what lets the producers run. So the consumer is always the
confined side here. Green contexts are made after torch and NVSHMEM initialised the primary context,
and none is ever left current: work reaches a partition only through its stream.

Work-queue policy (the hardware queues can still couple the partitions): keep the default number of
connections (never ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which starved the producer even with the split),
give the consumer its own stream, and enqueue producer work before the consumer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkring.env import check_work_queues
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

if TYPE_CHECKING:
    from chunkring.bringup import Runtime

__all__ = ["PartitionPlan", "plan_partition", "SmPartition"]


@dataclass(frozen=True)
class PartitionPlan:
    """SM counts of the two partitions: ``producer_sms + consumer_sms <= total_sms``."""

    total_sms: int
    producer_sms: int
    consumer_sms: int


def plan_partition(total_sms: int, min_partition: int, alignment: int, producer_sms: int) -> PartitionPlan:
    """Check a producer partition size against the device's rules; the consumer gets the remainder.

    ``producer_sms`` must be a multiple of ``alignment`` and at least ``min_partition`` (8 and 8 on
    sm_90), and leave the consumer at least ``min_partition`` SMs.
    """
    for name, value in (("total_sms", total_sms), ("min_partition", min_partition), ("alignment", alignment),
                        ("producer_sms", producer_sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ChunkringUsageError(f"must be a positive int, got {value!r}", field=name)
    if producer_sms % alignment:
        raise ChunkringUsageError(f"must be a multiple of the device's SM alignment {alignment}", field="producer_sms")
    if producer_sms < min_partition:
        raise ChunkringUsageError(f"below the device's minimum partition of {min_partition} SMs", field="producer_sms")
    consumer = total_sms - producer_sms
    if consumer < min_partition:
        raise ChunkringUsageError(f"leaves the consumer {consumer} of {total_sms} SMs; it needs at least "
                                  f"{min_partition}", field="producer_sms")
    return PartitionPlan(total_sms, producer_sms, consumer)


class SmPartition:
    """A producer and a consumer green context on this rank's GPU, with one torch stream each.

    ``producer_stream`` / ``consumer_stream`` are ``torch.cuda.ExternalStream`` objects; use them with
    ``torch.cuda.stream(...)`` or pass them to chunkring calls. Close it (or use ``with``) before the
    runtime closes. Several ranks sharing one GPU under MPS each make their own partition of the
    SMs MPS gives them.
    """

    def __init__(self, runtime: Runtime, producer_sms: int) -> None:
        check_work_queues()
        from cuda.core import ContextOptions, SMResourceOptions

        device = runtime.device
        try:
            sm = device.resources.sm
        except Exception as exc:
            raise ChunkringRuntimeError(f"this driver or GPU offers no green contexts: {exc}") from exc
        self.plan = plan_partition(sm.sm_count, sm.min_partition_size, sm.coscheduled_alignment, producer_sms)
        self.runtime = runtime
        self._contexts, self._streams = [], []
        try:
            groups, remainder = sm.split(SMResourceOptions(count=producer_sms))
            if len(groups) != 1 or groups[0].sm_count != producer_sms:
                raise ChunkringRuntimeError(f"asked for {producer_sms} producer SMs, the driver gave "
                                            f"{[g.sm_count for g in groups]}")
            streams = []
            for resource in (groups[0], remainder):
                context = device.create_context(ContextOptions(resources=[resource]))  # not made current
                self._contexts.append(context)
                streams.append(context.create_stream())
            self._streams = streams
        except ChunkringRuntimeError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise ChunkringRuntimeError(f"could not create the SM partitions: {exc}") from exc
        finally:
            device.set_current()  # the primary context stays current for torch and NVSHMEM
        import torch

        self.producer_stream, self.consumer_stream = (
            torch.cuda.ExternalStream(int(s.handle), device=runtime.torch_device) for s in self._streams)
        self.consumer_sms = remainder.sm_count

    def __repr__(self) -> str:
        return f"SmPartition(producer={self.plan.producer_sms} SMs, consumer={self.consumer_sms} SMs)"

    def close(self) -> None:
        """Destroy the streams and green contexts (after synchronising them)."""
        for stream in self._streams:
            stream.sync()
            stream.close()
        for context in self._contexts:
            context.close()
        self._streams, self._contexts = [], []

    def __enter__(self) -> SmPartition:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
