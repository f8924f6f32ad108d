"""A MoE layer's lifetime leaves nothing behind (issue: fail closed): 1,000 (``--lifetime-cycles``) create ->
streamed call -> destroy cycles of a small layer (4 ranks under MPS in scripts/gpu_suite.sh's ``lifetime_mps``
part, ``LIFETIME_RANKS``), measured, not assumed:

* NVSHMEM heap: the runtime's own account of live symmetric allocations (``Runtime.symmetric_usage``: tensors
  and bytes) is back to its size before the first layer after every destroy;
* green contexts: every layer's partition (``layer.partition``, the default ``partition="auto"``) is the runtime's
  shared one (``SmPartition.shared``) - one object, open, over every cycle: no cycle makes or destroys a green
  context;
* device memory: ``torch.cuda.mem_get_info`` (cudaMemGetInfo: what NVSHMEM's heap, green contexts, streams and
  kernels hold on the GPU, beyond the runtime's own account) after the last cycle against after the first (caches
  warm), within LEAK_BOUND_BYTES: a leak of even LEAK_BOUND_BYTES / cycles bytes per cycle fails;
* the output of every cycle is bit for bit the first cycle's.

The figures (before and after) go into the suite's JSON record through JUnit properties."""

import time

import pytest
import torch

from chunkring import MoELayer
from tests.helpers.layer_cells import Inputs, layer_config

pytestmark = pytest.mark.gpu

LEAK_BOUND_BYTES = 64 << 20
PROGRESS_EVERY = 100
#: Cycles between the ranks' agreement on whether the time limit has passed (a collective: all stop together).
TIME_CHECK_EVERY = 25


def settled_free_bytes(runtime) -> int:
    """Free device memory once every rank sharing the GPU has returned its cached blocks (measured at the same
    point of every rank's cycle: under MPS the ranks share one GPU's memory)."""
    runtime.barrier(timeout_s=120, what="the memory measurement")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    runtime.barrier(timeout_s=120, what="the memory measurement")
    return torch.cuda.mem_get_info(runtime.torch_device)[0]


def one_cycle(runtime, inputs, partitions):
    """Create, call (streamed), destroy; the output on the CPU. The ranks agree on whether the call failed
    anywhere before the destroy, so a rank that raised alone does not meet its peers' destroy at another
    barrier (barriers are numbered, not named) and the cycle fails on every rank alike."""
    layer = MoELayer(runtime, layer_config(runtime.world_size), timeout_s=60)
    if layer.partition is not None:
        partitions.append(layer.partition)
    out, failure = None, None
    try:
        out = layer.run(*inputs.args, *inputs.experts(layer), streaming=True).cpu()
        layer.check()
    except Exception as exc:  # reported below, on every rank
        failure = exc
    failed = [rank for rank, bad in enumerate(runtime.allgather_object(failure is not None)) if bad]
    layer.close()
    if failure is not None:
        raise failure
    if failed:
        raise AssertionError(f"the cycle's call failed on rank(s) {failed}")
    return out


def test_create_call_destroy_cycles_leak_nothing_and_stay_exact(runtime, lifetime_cycles, lifetime_seconds,
                                                               record_testsuite_property):
    inputs = Inputs(runtime)
    heap_before = runtime.symmetric_usage()
    partitions, not_exact, heap_changed, new_contexts = [], [], [], []
    started = time.monotonic()
    first = one_cycle(runtime, inputs, partitions)
    free_after_first = settled_free_bytes(runtime)
    ran = 1
    for cycle in range(1, lifetime_cycles):
        if lifetime_seconds is not None and cycle % TIME_CHECK_EVERY == 0 and any(
                runtime.allgather_object(time.monotonic() - started > lifetime_seconds)):
            break  # every rank sees the same list, so every rank stops here
        out = one_cycle(runtime, inputs, partitions)
        ran += 1
        if not torch.equal(out, first):
            not_exact.append(cycle)
        if runtime.symmetric_usage() != heap_before:
            heap_changed.append((cycle, runtime.symmetric_usage()))
        if partitions[-1] is not partitions[0] or partitions[0].closed:
            new_contexts.append(cycle)
        if cycle % PROGRESS_EVERY == 0 and runtime.rank == 0:
            print(f"lifetime: {cycle} cycles, {time.monotonic() - started:.0f} s", flush=True)
    seconds = time.monotonic() - started
    free_after_last = settled_free_bytes(runtime)
    heap_after = runtime.symmetric_usage()
    rank = runtime.rank
    figures = {"cycles": ran, "cycles_asked": lifetime_cycles, "seconds_per_cycle": round(seconds / ran, 4),
               "heap_tensors_before": heap_before[0], "heap_tensors_after": heap_after[0],
               "heap_bytes_before": heap_before[1], "heap_bytes_after": heap_after[1],
               "layers_with_a_partition": len(partitions),
               "distinct_partitions": len({id(p) for p in partitions}),
               "device_free_mib_after_first": round(free_after_first / 2**20, 1),
               "device_free_mib_after_last": round(free_after_last / 2**20, 1),
               "device_free_drift_mib": round((free_after_first - free_after_last) / 2**20, 1)}
    for name, value in figures.items():
        record_testsuite_property(f"lifetime_{name}_rank{rank}", value)
    assert not not_exact, f"cycles whose output differs from the first: {not_exact[:10]} ({len(not_exact)} in all)"
    assert not heap_changed, f"symmetric allocations left after destroy (cycle, (tensors, bytes)): {heap_changed[:5]}"
    assert partitions, "no layer had a partition: the green-context half of this test measured nothing"
    assert not new_contexts, f"cycles whose layer had another partition than the first's: {new_contexts[:10]}"
    fell_mib = (free_after_first - free_after_last) / 2**20
    assert free_after_first - free_after_last < LEAK_BOUND_BYTES, (
        f"device memory fell by {fell_mib:.1f} MiB over {ran - 1} cycles")
