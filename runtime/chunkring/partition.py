"""SM partitions: confine the persistent consumer so the producers it waits for always have SMs.

Measured on the H200 (docs/PROTOCOL.md, "Progress"): a consumer grid that fills the GPU and spins
starves its producers, even when the producers sit in their own green context; confining the *consumer*
to a green context that leaves SMs free is what lets the producers run. So the consumer is always the
confined side here. Green contexts are made after torch and NVSHMEM initialised the primary context,
and none is ever left current: work reaches a partition only through its stream.

Work-queue policy (the hardware queues can still couple the partitions): keep the default number of
connections (never ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which starved the producer even with the split),
give the consumer its own stream, and enqueue nothing that waits for a spinning kernel before the work that
kernel waits for (docs/PROTOCOL.md, "Progress" 10).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkring.env import check_work_queues
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

if TYPE_CHECKING:
    from chunkring.runtime import Runtime

__all__ = ["DEFAULT_PARTITION", "PRODUCER_SM_SHARE", "NO_PARTITION", "PartitionPlan", "SmPartition",
           "check_partition_arg", "default_producer_sms", "plan_partition"]

#: ``MoELayer(partition=...)``: the library sizes a partition for streamed calls (:func:`default_producer_sms`).
DEFAULT_PARTITION = "auto"
#: ``MoELayer(partition=...)``: no partition; every call on ordinary streams over the whole GPU.
NO_PARTITION = "none"

#: The producers' share of the SMs where the consumer partition also runs expert GEMMs (the waves of
#: ``MoEConfig.waves > 1``): fewer producer SMs slow the router GEMM, the quantisation and the reduction more
#: than the overlap saves, more slow the waves' GEMMs (docs/PERFORMANCE.md, "SM partition"). Where the
#: consumer partition runs only the pull (``waves == 1``: the GEMMs run over the whole GPU once every chunk is
#: in), the producers take every SM the pull does not need (``share=None``).
PRODUCER_SM_SHARE = 0.25


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


def default_producer_sms(total_sms: int, min_partition: int, alignment: int, consumer_grid: int,
                         consumer_blocks_per_sm: int, share: float | None = PRODUCER_SM_SHARE) -> int:
    """The producer partition's size when the caller names none: ``share`` of ``total_sms`` rounded to the
    device's ``alignment`` (at least ``min_partition``), or with ``share=None`` every SM the consumer does not
    need; shrunk where needed so that the consumer partition keeps its whole grid resident at once -
    ``consumer_grid`` blocks at ``consumer_blocks_per_sm`` per SM (a consumer block that cannot start stalls
    the others, docs/PROTOCOL.md "Progress") - and at least ``min_partition`` SMs. ``ChunkringUsageError``
    (field ``partition``) where no split satisfies both sides: a GPU or MPS share too small to split; run
    such a layer with ``partition="none"``."""
    for name, value in (("total_sms", total_sms), ("min_partition", min_partition), ("alignment", alignment),
                        ("consumer_grid", consumer_grid), ("consumer_blocks_per_sm", consumer_blocks_per_sm)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ChunkringUsageError(f"must be a positive int, got {value!r}", field=name)
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1):
        raise ChunkringUsageError(f"must be in (0, 1) or None, got {share!r}", field="share")
    consumer_needs = max(min_partition, -(-consumer_grid // consumer_blocks_per_sm))
    lowest = -(-min_partition // alignment) * alignment  # the smallest aligned producer partition
    wanted = total_sms if share is None else max(lowest, alignment * round(total_sms * share / alignment))
    most = (total_sms - consumer_needs) // alignment * alignment
    producer = min(wanted, most)
    if producer < lowest:
        raise ChunkringUsageError(
            f"{total_sms} SMs cannot hold a producer partition of at least {min_partition} SMs and a consumer "
            f"partition of {consumer_needs} (its {consumer_grid} blocks resident); pass partition=\"none\"",
            field="partition")
    return producer


def check_partition_arg(partition: object, runtime: Runtime | None = None) -> str | SmPartition:
    """``MoELayer``'s ``partition`` argument as given, or ``ChunkringUsageError``: an open :class:`SmPartition`
    (of ``runtime``, if given), ``"auto"`` (:data:`DEFAULT_PARTITION`) or ``"none"`` (:data:`NO_PARTITION`).
    ``None`` is refused rather than guessed at: it read as "no partition" before the default became one."""
    if isinstance(partition, SmPartition):
        if partition.closed:
            raise ChunkringUsageError("this SmPartition is closed: its streams are gone", field="partition")
        if runtime is not None and partition.runtime is not runtime:
            raise ChunkringUsageError("this SmPartition belongs to another runtime", field="partition")
        return partition
    if isinstance(partition, str) and partition in (DEFAULT_PARTITION, NO_PARTITION):
        return partition
    raise ChunkringUsageError(f'expected an SmPartition, "{DEFAULT_PARTITION}" or "{NO_PARTITION}", got '
                              f"{partition!r}", field="partition")


class SmPartition:
    """A producer and a consumer green context on this rank's GPU: one torch stream on the producer's SMs,
    two on the consumer's.

    ``producer_stream`` / ``consumer_stream`` are ``torch.cuda.ExternalStream`` objects; use them with
    ``torch.cuda.stream(...)`` or pass them to chunkring calls. ``consumer_side_stream`` runs work beside
    the consumer stream on the same SMs (the MoE layer's incremental pull, concurrent with its waves).
    Close it (or use ``with``) before the runtime closes. Several ranks sharing one GPU under MPS each make
    their own partition of the SMs MPS gives them.

    :meth:`shared` returns the runtime's own partition of a size instead: one per size for every layer that
    asks, so a model of many layers holds one pair of green contexts, and creating and destroying layers never
    creates or destroys one: the driver keeps device memory per green context made, destroyed or not (4 MiB on
    the H200, scripts/probe_memory_drift.py), so a partition per layer lifetime would leak.
    """

    def __init__(self, runtime: Runtime, producer_sms: int) -> None:
        check_work_queues()
        from cuda.core import ContextOptions, SMResourceOptions

        device = runtime.device
        sm = _sm_resource(runtime)
        self.plan = plan_partition(sm.sm_count, sm.min_partition_size, sm.coscheduled_alignment, producer_sms)
        self.runtime = runtime
        self._contexts, self._streams = [], []
        self._shared = False  # the runtime's (shared): Runtime.close() destroys it, close() refuses
        try:
            groups, remainder = sm.split(SMResourceOptions(count=producer_sms))
            if len(groups) != 1 or groups[0].sm_count != producer_sms:
                raise ChunkringRuntimeError(f"asked for {producer_sms} producer SMs, the driver gave "
                                            f"{[g.sm_count for g in groups]}")
            for resource, count in ((groups[0], 1), (remainder, 2)):
                context = device.create_context(ContextOptions(resources=[resource]))  # not made current
                self._contexts.append(context)
                for _ in range(count):  # each kept as soon as made, so that a failure closes it too
                    self._streams.append(context.create_stream())
            import torch

            self.producer_stream, self.consumer_stream, self.consumer_side_stream = (
                torch.cuda.ExternalStream(int(s.handle), device=runtime.torch_device) for s in self._streams)
        except ChunkringRuntimeError:
            self._release_quietly()
            raise
        except Exception as exc:
            self._release_quietly()
            raise ChunkringRuntimeError(f"could not create the SM partitions: {exc}") from exc
        finally:
            device.set_current()  # the primary context stays current for torch and NVSHMEM
        self.consumer_sms = remainder.sm_count

    @classmethod
    def shared(cls, runtime: Runtime, consumer_grid: int, consumer_blocks_per_sm: int, *,
               share: float | None = PRODUCER_SM_SHARE) -> SmPartition:
        """The runtime's partition for a consumer of ``consumer_grid`` blocks (``consumer_blocks_per_sm``
        resident per SM) on this rank's GPU, or this GPU's share under MPS: :func:`default_producer_sms` of the
        SMs the driver reports (``share`` as there), with the device's minimum partition and alignment. Made at
        the first request for its size and returned to every later one; :meth:`Runtime.close` destroys it
        (:meth:`Runtime.at_close`; :meth:`close` refuses). Work of several layers on its streams runs in the
        order it was enqueued, the producers' before the consumer's, as one layer's does."""
        check_work_queues()
        sm = _sm_resource(runtime)
        producer_sms = default_producer_sms(sm.sm_count, sm.min_partition_size, sm.coscheduled_alignment,
                                            consumer_grid, consumer_blocks_per_sm, share)
        sizes = _SHARED.get(runtime)
        if sizes is None:
            sizes = _SHARED[runtime] = {}
            runtime.at_close(lambda: _destroy_shared(runtime))
        partition = sizes.get(producer_sms)
        if partition is None:
            partition = sizes[producer_sms] = cls(runtime, producer_sms)
            partition._shared = True
        return partition

    def __repr__(self) -> str:
        return f"SmPartition(producer={self.plan.producer_sms} SMs, consumer={self.consumer_sms} SMs)"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (itself, through ``with``, or through the layer that made this partition):
        no stream or green context of it is left."""
        return not self._streams and not self._contexts

    def close(self) -> None:
        """Destroy the streams and green contexts (after synchronising them). A partition from :meth:`shared` is
        its runtime's: ``ChunkringUsageError``, :meth:`Runtime.close` destroys it."""
        if self._shared:
            raise ChunkringUsageError("this partition is shared by its runtime's layers (SmPartition.shared); "
                                      "Runtime.close() destroys it", field="partition")
        self._release()

    def _release(self) -> None:
        """Synchronise and close every stream, then close every green context - each one whatever failed before
        it, so that one failure leaks nothing - and raise the first failure as ``ChunkringRuntimeError``."""
        streams, contexts = self._streams, self._contexts
        self._streams, self._contexts = [], []
        failures: list[Exception] = []
        for step in [step for s in streams for step in (s.sync, s.close)] + [c.close for c in contexts]:
            try:
                step()
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise ChunkringRuntimeError(f"could not destroy the SM partitions cleanly ({len(failures)} failures; "
                                        f"the first: {failures[0]})") from failures[0]

    def _release_quietly(self) -> None:
        """:meth:`_release` on a construction's way out: the construction's own error is the one to raise."""
        with contextlib.suppress(ChunkringRuntimeError):
            self._release()

    def __enter__(self) -> SmPartition:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Each open runtime's shared partitions by producer SM count (:meth:`SmPartition.shared`).
_SHARED: weakref.WeakKeyDictionary[Runtime, dict[int, SmPartition]] = weakref.WeakKeyDictionary()


def _destroy_shared(runtime: Runtime) -> None:
    """Destroy each of ``runtime``'s shared partitions, every one even if an earlier one fails; raise the first."""
    failure: ChunkringRuntimeError | None = None
    for partition in _SHARED.pop(runtime).values():
        try:
            partition._release()
        except ChunkringRuntimeError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def _sm_resource(runtime: Runtime) -> Any:  # cuda.core's SMResource
    try:
        return runtime.device.resources.sm
    except Exception as exc:
        raise ChunkringRuntimeError(f"this driver or GPU offers no green contexts (a MoELayer runs without "
                                    f'a partition with partition="none"): {exc}') from exc
