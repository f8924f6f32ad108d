"""Where device memory goes over create/destroy cycles on one rank: free device memory (after empty_cache) per
cycle of (1) a small streamed MoE layer with its default SM partition, (2) the same with partition="none", (3) a
bare SmPartition created and closed, (4) the same with one torch kernel run on each of its streams. The lifetime
test (tests/lifetime) measures the whole; this says which part drifts.
    python scripts/probe_memory_drift.py [--cycles 100] [--json PATH]"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers, from a checkout

import torch  # noqa: E402

import chunkring  # noqa: E402
from chunkring import MoELayer, SmPartition  # noqa: E402
from chunkring.testing import records  # noqa: E402
from tests.helpers.layer_cells import Inputs, layer_config  # noqa: E402


def free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def ok(result: tuple):
    """A cuda.bindings call's result past its CUresult, which must be CUDA_SUCCESS: None, the one value, or the
    tuple of them."""
    from cuda.bindings import driver

    assert result[0] == driver.CUresult.CUDA_SUCCESS, result[0]
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def drift_mib(step, cycles: int) -> float:
    step()  # the first cycle loads what stays loaded (modules, the allocator's pools)
    before = free_bytes()
    for _ in range(cycles):
        step()
    return (before - free_bytes()) / 2**20 / cycles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runtime = chunkring.init()
    inputs = Inputs(runtime)

    def layer(partition):
        def step():
            moe = MoELayer(runtime, layer_config(1), timeout_s=60, partition=partition)
            moe.run(*inputs.args, *inputs.experts(moe), streaming=True)
            torch.cuda.synchronize()
            moe.close()
        return step

    def bare(run_kernel: bool):
        def step():
            with SmPartition(runtime, 64) as part:
                if run_kernel:
                    for stream in (part.producer_stream, part.consumer_stream, part.consumer_side_stream):
                        with torch.cuda.stream(stream):
                            torch.ones(1, device=runtime.torch_device).add_(1)
                    torch.cuda.synchronize()
        return step

    def contexts_only():  # cuda.core's green contexts without streams: is it the streams or the contexts?
        from cuda.core import ContextOptions, SMResourceOptions

        groups, remainder = runtime.device.resources.sm.split(SMResourceOptions(count=64))
        for resource in (groups[0], remainder):
            runtime.device.create_context(ContextOptions(resources=[resource])).close()
        runtime.device.set_current()

    def driver_green_context():  # the driver alone: cuGreenCtxCreate / cuGreenCtxDestroy, no cuda.core object
        from cuda.bindings import driver

        sm = ok(driver.cuDeviceGetDevResource(runtime.ordinal, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        desc = ok(driver.cuDevResourceGenerateDesc([sm], 1))
        ok(driver.cuGreenCtxDestroy(ok(driver.cuGreenCtxCreate(
            desc, runtime.ordinal, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))))

    def driver_partition():  # SmPartition's shape through the driver alone: a split, two contexts, 1 + 2 streams
        from cuda.bindings import driver

        sm = ok(driver.cuDeviceGetDevResource(runtime.ordinal, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        groups, _, remainder = ok(driver.cuDevSmResourceSplitByCount(1, sm, 0, 64))
        flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        made = []
        for resource, count in ((groups[0], 1), (remainder, 2)):
            ctx = ok(driver.cuGreenCtxCreate(ok(driver.cuDevResourceGenerateDesc([resource], 1)), runtime.ordinal,
                                             flags))
            streams = [ok(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
                       for _ in range(count)]
            made.append((ctx, streams))
        for ctx, streams in made:
            for stream in streams:
                ok(driver.cuStreamDestroy(stream))
            ok(driver.cuGreenCtxDestroy(ctx))

    def bare_collected():  # a bare partition, then the garbage collector: does a cycle hold the handles?
        import gc

        bare(False)()
        gc.collect()

    figures = {}
    for name, step in (("layer_default_partition", layer("auto")), ("layer_no_partition", layer("none")),
                       ("bare_partition", bare(False)), ("partition_with_torch_kernels", bare(True)),
                       ("cuda_core_contexts_only", contexts_only), ("driver_green_context", driver_green_context),
                       ("driver_partition", driver_partition), ("bare_partition_collected", bare_collected)):
        figures[f"{name}_mib_per_cycle"] = round(drift_mib(step, args.cycles), 3)
        print(f"{name}: {figures[f'{name}_mib_per_cycle']} MiB per cycle over {args.cycles}", flush=True)
    if args.json:
        records.write(args.json, suite="memory-drift", world_size=1, figures=figures)
    runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
