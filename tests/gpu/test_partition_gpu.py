"""Green-context partitions on the GPU: the streams work, the primary context stays current, and a
consumer confined to its partition lets a producer on the other partition make progress."""

import pytest
import torch

from chunkring.errors import ChunkringUsageError
from chunkring.partition import SmPartition

pytestmark = pytest.mark.gpu


def test_streams_run_torch_work_and_primary_context_stays_current(runtime):
    with SmPartition(runtime, producer_sms=16) as part:
        assert part.plan.producer_sms == 16 and part.consumer_sms >= 8
        a = torch.randn(256, 256, device=runtime.torch_device)
        results = []
        for stream in (part.producer_stream, part.consumer_stream):
            with torch.cuda.stream(stream):
                results.append(a @ a)
        torch.cuda.synchronize()
        assert torch.allclose(results[0], results[1])
        assert torch.cuda.current_stream().cuda_stream not in (part.producer_stream.cuda_stream,
                                                               part.consumer_stream.cuda_stream)
        # The primary context is current: an ordinary allocation and kernel still work.
        assert torch.ones(4, device=runtime.torch_device).sum().item() == 4


def _layer_config(runtime, streaming=True):
    from chunkring import MoEConfig

    W = runtime.world_size
    ring = {"stream_slots": 2, "stream_slot_tokens": 16} if streaming else {}
    return MoEConfig(num_experts=2 * W, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=64, **ring)


def _routed_call(layer, n, seed):
    """A routed FP8 batch of ``n`` tokens for ``layer.run`` (x, x_sf, topk_idx, topk_weights on its device), drawn
    from ``seed``, and this rank's experts of the weights seed 3 draws."""
    from chunkring.testing.reference import quantize_fp8_per128
    from tests.gpu.moe_helpers import local_weights, routing, weights

    cfg, device = layer.config, layer.runtime.torch_device
    w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(seed)
    xq, sf = quantize_fp8_per128(torch.randn(n, cfg.hidden, generator=gen))
    idx, w = routing(n, cfg.num_experts, cfg.topk, "uniform", gen)
    return [t.to(device) for t in (xq, sf, idx, w)], local_weights(layer, w13, w2)


def test_streaming_layer_confines_streamed_calls_to_a_default_partition(runtime):
    """partition="auto" (the default): streamed calls on the runtime's partition of the size the layer needs,
    batch-ready calls on whole-GPU streams; both modes give the same output; the partition outlives the layer
    (the runtime's: shared with the next layer of that size, refused to a caller's close())."""
    from chunkring import MoELayer
    from chunkring.moe import CallMode
    from chunkring.moe._engine.producer import PRODUCE_MAX_BLOCKS
    from chunkring.moe._engine.resources import PULL_GRID

    cfg = _layer_config(runtime)
    layer = MoELayer(runtime, cfg)
    part = layer.partition
    try:
        sm = runtime.device.resources.sm
        resident = layer.resources.kernels.stream.resident_blocks_per_sm("moe_pull", 256)
        # One wave: the consumer partition is reserved for the pull alone - the fewest aligned SMs that hold its
        # whole grid - and the producers get every other SM (the GEMMs run on the whole GPU after the pull).
        needs = max(sm.min_partition_size, -(-PULL_GRID // resident))
        assert part is not None and part.plan.producer_sms + part.consumer_sms == sm.sm_count
        assert needs <= part.consumer_sms < needs + sm.coscheduled_alignment, part
        # The driver's rules for a green context, and the device's own SM count (the green-context resource
        # may be an MPS share of it, never more).
        assert part.plan.producer_sms % sm.coscheduled_alignment == 0, part
        assert min(part.plan.producer_sms, part.consumer_sms) >= sm.min_partition_size, part
        assert sm.sm_count <= torch.cuda.get_device_properties(runtime.torch_device).multi_processor_count
        stats = layer.stats()
        assert (stats["producer_sms"], stats["consumer_sms"]) == (part.plan.producer_sms, part.consumer_sms)
        # Every rank on this GPU spins its pull and producer grids in its share of each side (Progress 8): all
        # ranks' pull blocks resident at once, and where ranks share the GPU one SM per spinning producer block.
        assert stats["pull_grid"] * runtime.gpu_ranks <= part.consumer_sms * resident
        if runtime.gpu_ranks == 1:
            assert (stats["pull_grid"], stats["producer_grid_max"]) == (PULL_GRID, PRODUCE_MAX_BLOCKS)
        else:
            assert stats["pull_grid"] <= part.consumer_sms // runtime.gpu_ranks
            assert stats["producer_grid_max"] * runtime.gpu_ranks < part.plan.producer_sms
        assert layer.streams(CallMode.STREAMED) == (part.producer_stream, part.consumer_stream)
        batch_streams = {s.cuda_stream for s in layer.streams(CallMode.BATCH_READY)}
        assert batch_streams.isdisjoint({part.producer_stream.cuda_stream, part.consumer_stream.cuda_stream})
        args, experts = _routed_call(layer, 61, 50 + runtime.rank)
        outs = [layer.run(*args, *experts, streaming=streaming) for streaming in (False, True)]
        torch.cuda.synchronize()
        layer.check()
        assert torch.equal(outs[0], outs[1])
    finally:
        layer.close()
    assert not part.closed  # the runtime's, not the layer's
    again = MoELayer(runtime, cfg)
    try:
        assert again.partition is part  # the same green contexts and streams: no new one per layer
    finally:
        again.close()
    with pytest.raises(ChunkringUsageError, match="Runtime.close"):
        part.close()
    assert not part.closed


def test_no_partition_on_request_or_without_a_streaming_ring(runtime):
    from chunkring import MoELayer
    from chunkring.moe import CallMode

    for cfg, partition in ((_layer_config(runtime), "none"), (_layer_config(runtime, streaming=False), "auto")):
        layer = MoELayer(runtime, cfg, partition=partition)
        try:
            assert layer.partition is None and layer.stats()["producer_sms"] == 0
            assert layer.streams(CallMode.STREAMED) == layer.streams(CallMode.BATCH_READY)
        finally:
            layer.close()


def test_a_captured_streamed_call_keeps_its_partition(runtime):
    """A streamed call captured in a CUDA graph (a caller's capture, or the layer's own replay of eager calls) keeps
    the partition that protects the pull's progress (docs/PROTOCOL.md, "Progress" and "CUDA graphs"): the graph's
    pull node runs in the consumer's green context, the drain (on the producer stream) in the producer's, and the
    expert work, which spins on nothing, in the primary context - each node's context as the driver records it at
    capture."""
    from cuda.bindings import driver

    from chunkring import MoELayer
    from chunkring.jit.graph_nodes import kernel_nodes, ok

    def stream_context(stream: torch.cuda.Stream) -> int:
        return int(ok(driver.cuStreamGetCtx(driver.CUstream(stream.cuda_stream))))

    cfg = _layer_config(runtime)
    with MoELayer(runtime, cfg) as layer:
        part = layer.partition
        assert part is not None
        args, experts = _routed_call(layer, 33, 60 + runtime.rank)
        eager = layer.run(*args, *experts, streaming=True)  # the mode's first call: warm-up and barrier
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            replayed = layer.run(*args, *experts, streaming=True)
        kernels = [(node.name, node.ctx) for node in kernel_nodes(graph.raw_cuda_graph())]
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        layer.check()
        assert torch.equal(replayed, eager)
        contexts = {name: {ctx for n, ctx in kernels if n == name} for name, _ in kernels}
        if not any(ctx for _, ctx in kernels):  # CUDA documents a node's context as ignored where its function is set
            pytest.skip(f"the driver recorded no context on any of the graph's {len(kernels)} kernel nodes: the graph "
                        "does not say where they run")
        consumer, producer = stream_context(part.consumer_stream), stream_context(part.producer_stream)
        assert consumer != producer
        assert contexts.get("moe_pull") == {consumer}, contexts
        assert contexts.get("moe_drain") == {producer}, contexts
        assert any(ctx not in (consumer, producer) for ctx in set().union(*contexts.values())), contexts
