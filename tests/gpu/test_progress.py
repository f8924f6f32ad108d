"""Progress (docs/PROTOCOL.md, "Progress"): a call completes whatever order its two sides run in, and a
wait that cannot complete ends in a typed error naming who was waited for - never a hang.

* serialized: every producer runs to completion (host-synchronised) before any consumer starts;
* consumer first with the smallest grid (one block), the ring wrapping inside the call;
* consumer first with a grid that fills its green-context partition (the persistent-consumer shape);
* negative control: the same grid filling the whole GPU without a partition starves the producer, and
  the watchdog reports it (in-process: kernels return instead of trapping, so the context survives);
* a producer delayed by seconds on one rank, an empty rank, through the MoE layer on a partition;
* a rank that never publishes: every rank's consumer times out with the record naming it.
"""

import time

import pytest
import torch

from chunkring import ChunkringPeerAbortedError, ChunkringTimeoutError, MoEConfig, MoELayer, SmPartition
from chunkring.ring.io import GatherOutputs, gather, gather_grid_limit
from chunkring.ring.status import ErrorCode, Site
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from tests.gpu.moe_helpers import H, layer_reference, local_weights, rel_error, routing, tolerance, weights
from tests.gpu.ring_helpers import T, check_gathered, make_ring, publish_all

pytestmark = pytest.mark.gpu

SPIN_FIRST_S = 0.3  # how long the consumer spins alone before any producer is enqueued


def counts_for(world: int, chunks: int) -> list[int]:
    """Tokens per rank: the last rank empty, the others ``chunks`` chunks with a partial last one."""
    return [0 if world > 1 and r == world - 1 else chunks * T - 3 for r in range(world)]


def test_producers_complete_before_the_consumer_starts(runtime):
    """Serialized execution: at most S chunks per source, so no producer waits for an ack."""
    slots = 3
    counts = counts_for(runtime.world_size, slots)
    with make_ring(runtime, slots) as ring:
        for invocation in range(3):
            out = GatherOutputs(ring, slots * T)
            publish_all(runtime, ring, counts[runtime.rank], invocation, torch.cuda.current_stream())
            torch.cuda.synchronize()
            runtime.barrier()  # every rank's producers have finished
            gather(ring, out, grid=1)
            check_gathered(runtime, ring, out, counts, invocation)
            runtime.barrier()
            out.close()


def test_consumer_first_with_the_smallest_grid(runtime):
    """One consumer block, launched first and spinning; five chunks wrap a two-slot ring."""
    counts = counts_for(runtime.world_size, 5)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with make_ring(runtime, 2) as ring:
        out = GatherOutputs(ring, 5 * T)
        torch.cuda.synchronize()
        gather(ring, out, grid=1, stream=consumer)
        time.sleep(SPIN_FIRST_S)
        publish_all(runtime, ring, counts[runtime.rank], 0, producer)
        check_gathered(runtime, ring, out, counts, 0)
        out.close()


def test_consumer_first_filling_its_partition(runtime):
    """The persistent-consumer shape: every SM of the consumer partition full of spinning blocks before
    any producer runs. The producers, on their own partition, still run."""
    counts = counts_for(runtime.world_size, 5)
    with make_ring(runtime, 2) as ring, SmPartition(runtime, producer_sms=16) as part:
        # Ranks sharing one GPU under MPS share the consumer partition's SMs: this rank fills its share.
        grid = gather_grid_limit(ring, part.consumer_sms // runtime.gpu_ranks)
        for invocation in range(2):
            out = GatherOutputs(ring, 5 * T)
            torch.cuda.synchronize()
            runtime.barrier()
            gather(ring, out, grid=grid, stream=part.consumer_stream)
            time.sleep(SPIN_FIRST_S)
            publish_all(runtime, ring, counts[runtime.rank], invocation, part.producer_stream)
            check_gathered(runtime, ring, out, counts, invocation)
            out.close()


def test_consumer_filling_the_gpu_without_a_partition_starves_the_producer(runtime):
    """Negative control for the test above: the watchdog fires, naming the wait and the silent source."""
    if runtime.world_size > 1:
        pytest.skip("one rank owns the whole GPU only when it runs alone")
    sms = torch.cuda.get_device_properties(runtime.torch_device).multi_processor_count
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with make_ring(runtime, 2, timeout_s=3.0) as ring:
        out = GatherOutputs(ring, 5 * T)
        torch.cuda.synchronize()
        gather(ring, out, grid=gather_grid_limit(ring, sms), stream=consumer)
        time.sleep(SPIN_FIRST_S)
        publish_all(runtime, ring, 5 * T - 3, 0, producer)
        torch.cuda.synchronize()
        with pytest.raises(ChunkringTimeoutError) as info:
            ring.check()
        record = info.value.record
        assert (record.site, record.peer, record.slot, record.observed) == (Site.WAIT_ROUTE, 0, 0, 0), record
        assert "TIMEOUT while waiting" in str(info.value)
        # The context survived (no trap): a reset and a normal call work.
        out.close()
        ring.reset()
        out = GatherOutputs(ring, T)
        publish_all(runtime, ring, T, 1, producer)
        gather(ring, out, stream=consumer)
        check_gathered(runtime, ring, out, [T], 1)
        out.close()


def test_a_silent_rank_times_out_every_consumer_with_its_name(runtime):
    """Also: the watchdog limit set for one call (``set_timeout``) is the one that fires. The first consumer
    whose watchdog fires aborts the ring, so a peer still waiting reports ``ChunkringPeerAbortedError``
    naming that consumer - its own record still names the wait and the silent rank."""
    W = runtime.world_size
    with make_ring(runtime, 1, timeout_s=60.0) as ring:
        out = GatherOutputs(ring, T)
        if runtime.rank != 0:  # rank 0 never publishes
            publish_all(runtime, ring, T, 0, torch.cuda.current_stream())
        ring.set_timeout(2.0)
        start = time.monotonic()
        gather(ring, out)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 20, "the 2 s limit set for this call did not apply"
        with pytest.raises((ChunkringTimeoutError, ChunkringPeerAbortedError)) as info:
            ring.check()
        record = ring.status()
        assert (record.pe, record.site, record.peer, record.slot) == (runtime.rank, Site.WAIT_ROUTE, 0, 0), record
        timed_out = runtime.allgather_object(record.code == ErrorCode.TIMEOUT)
        if isinstance(info.value, ChunkringPeerAbortedError):
            assert info.value.code == ErrorCode.TIMEOUT and timed_out[info.value.origin_rank], info.value
        else:
            assert record.observed == 0, record
        assert any(timed_out)
        runtime.barrier()
        out.close()
        ring.reset()
        ring.set_timeout(60.0)
        out = GatherOutputs(ring, T)
        publish_all(runtime, ring, T, 1, torch.cuda.current_stream())
        gather(ring, out)
        check_gathered(runtime, ring, out, [T] * W, 1)
        out.close()


@pytest.mark.parametrize("which", ["given", "default"])
def test_layer_on_a_partition_with_a_delayed_producer_and_an_empty_rank(runtime, which):
    """The streamed layer on green-context streams - a partition the caller made, or the one the layer
    makes by default; the last rank sleeps 3 s before its call (its peers' consumers wait for it), the first
    rank has no tokens."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=128, topk=2, max_tokens_per_rank=64,
                    stream_slots=2, stream_slot_tokens=16)
    w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(40 + rank)
    n = 0 if rank == 0 and W > 1 else 61
    xq, sf = quantize_fp8_per128(torch.randn(n, H, generator=gen))
    idx, w = routing(n, cfg.num_experts, 2, "uniform", gen)
    args = [t.to(device) for t in (xq, sf, idx, w)]
    with SmPartition(runtime, producer_sms=16) as part:
        layer = MoELayer(runtime, cfg, partition=part if which == "given" else "auto", timeout_s=60)
        assert layer.partition is not None and (layer.partition is part) == (which == "given")
        try:
            experts = local_weights(layer, w13, w2)
            ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), idx, w, w13, w2)
            plain = None
            for delayed in (False, True):
                runtime.barrier()
                if delayed and rank == W - 1:
                    time.sleep(3.0)
                out = layer.run(*args, *experts, streaming=True)
                torch.cuda.synchronize()
                layer.check()
                assert rel_error(out, ref) <= tolerance(layer)
                if plain is not None:
                    assert torch.equal(out, plain)
                plain = out
        finally:
            layer.close()


def test_a_first_call_waits_for_every_ranks_gemm_warm_up(runtime, monkeypatch):
    """A rank's first call of a mode compiles and loads its GEMM kernels (ExpertCompute.warm_up), which can
    take longer than the watchdog; its peers must not start spinning meanwhile. The last rank's warm-up
    sleeps twice the layer's 2 s watchdog: every rank's first call of each mode still completes, because
    nothing spins before every rank's warm-up (one host barrier per mode, none after: counted)."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    if W < 2:
        pytest.skip("a peer's warm-up outlasting the watchdog needs a peer")
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=128, topk=2, max_tokens_per_rank=64,
                    stream_slots=2, stream_slot_tokens=16)
    w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(70 + rank)
    xq, sf = quantize_fp8_per128(torch.randn(48, H, generator=gen))
    idx, w = routing(48, cfg.num_experts, 2, "uniform", gen)
    args = [t.to(device) for t in (xq, sf, idx, w)]
    barriers = []
    host_barrier = runtime.host_barrier
    monkeypatch.setattr(runtime, "host_barrier", lambda **kw: (barriers.append(1), host_barrier(**kw))[1])
    layer = MoELayer(runtime, cfg, timeout_s=2.0)
    try:
        if rank == W - 1:
            warm_up = layer.resources.compute.warm_up

            def slow_warm_up(*a, **kw):
                time.sleep(4.0)
                warm_up(*a, **kw)

            monkeypatch.setattr(layer.resources.compute, "warm_up", slow_warm_up)
        experts = local_weights(layer, w13, w2)
        ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), idx, w, w13, w2)
        runtime.barrier()
        barriers.clear()
        for streaming in (False, True, False, True):
            out = layer.run(*args, *experts, streaming=streaming)
            torch.cuda.synchronize()
            layer.check()
            assert rel_error(out, ref) <= tolerance(layer)
        assert len(barriers) == 2, f"{len(barriers)} host barriers in 4 calls of 2 modes"
    finally:
        layer.close()
