"""CUDA-graph capture and replay of the MoE layer's streamed call (and the batch-ready one).

A call is captured once with fixed shapes: ``max_tokens`` rows, the real count in a device int32 that
the test rewrites before every replay (zero on some ranks in some replays, rarely a multiple of the
chunk size). Before each replay fresh inputs are written into the captured tensors; after it an eager
call on the same layer (same rings, so eager calls and replays interleave on the ring's device-resident
sequence numbers and wrap its slots) computes the same output, which must match bit for bit - the same
kernels in the same order - and every 100th replay is also checked against the fp32 reference.

A replay takes no value from the host: generations, epochs and cursors live on the device, so a graph
that had baked in a host counter would wait for a chunk that never comes (watchdog) or read stale
chunks (mismatch) from its second replay on.
"""

import gc

import pytest
import torch

from tests.gpu.graph_helpers import MAX_TOKENS, Batch, check_replay, make_layer, strict_capture
from tests.gpu.moe_helpers import H, layer_reference, rel_error, tolerance

pytestmark = pytest.mark.gpu

REPLAYS = 1000


def capture(layer, batch, experts, out, *, streaming):
    """One eager warm-up call, then the captured call; any host synchronisation inside raises."""
    def call():
        return layer.run(*batch.args(), *experts, streaming=streaming, out=out, num_tokens=batch.count)

    call()
    torch.cuda.synchronize()
    return strict_capture(call)[0]


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "batch_ready"])
def test_replays_match_eager_calls(runtime, streaming):
    layer, experts, reference = make_layer(runtime)
    try:
        batch = Batch(runtime, layer.config)
        out = torch.zeros(MAX_TOKENS, H, dtype=torch.bfloat16, device=runtime.torch_device)
        graph = capture(layer, batch, experts, out, streaming=streaming)
        replays = REPLAYS if streaming else REPLAYS // 10
        for step in range(replays):
            check_replay(layer, batch, experts, graph, out, step, streaming=streaming,
                         reference=reference if step % 100 == 0 else None)
        # A reset between replay series: the graph reads the new epoch from device memory.
        layer.reset()
        for step in range(replays, replays + 20):
            check_replay(layer, batch, experts, graph, out, step, streaming=streaming, reference=reference)
    finally:
        layer.close()


def test_capture_after_reset_and_no_allocation_during_replay(runtime):
    layer, experts, reference = make_layer(runtime)
    try:
        batch = Batch(runtime, layer.config)
        out = torch.zeros(MAX_TOKENS, H, dtype=torch.bfloat16, device=runtime.torch_device)
        layer.run(*batch.args(), *experts, streaming=True, num_tokens=batch.count)
        layer.reset()
        torch.cuda.synchronize()

        def held():  # bytes held by live tensors, after freeing what is already garbage
            gc.collect()  # torch.cuda.graph collects too: garbage must not count as a capture's effect
            return torch.cuda.memory_stats()["allocated_bytes.all.current"]

        scratch = torch.zeros(8, device=runtime.torch_device)
        trivial_graphs = [torch.cuda.CUDAGraph() for _ in range(2)]  # kept alive, like the graph below
        for trivial in trivial_graphs:  # the second shows what torch itself keeps per captured graph
            before = held()
            with torch.cuda.graph(trivial):
                scratch.add_(1)
            graph_overhead = held() - before
        before = held()
        graph = capture(layer, batch, experts, out, streaming=True)
        # Whatever the captured region allocated lives in the graph's private pool and was released
        # when capture ended: nothing it allocated is still held.
        assert held() - before == graph_overhead
        batch.fill(1)
        stats = torch.cuda.memory_stats()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        for key in ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.current"):
            assert after[key] == stats[key], f"{key} changed during replays"
        layer.check()
        for step in range(2, 12):
            check_replay(layer, batch, experts, graph, out, step, streaming=True, reference=reference)
    finally:
        layer.close()


def test_bad_count_is_clamped_and_reported(runtime):
    """A count outside [0, n] is clamped on the device and reported by check() - never an index; the
    call completes on every rank (a masked input is not a protocol error)."""
    from chunkring import ChunkringInputError
    from chunkring.ring.status import InputField

    layer, experts, reference = make_layer(runtime)
    try:
        batch = Batch(runtime, layer.config)
        for bad in (MAX_TOKENS + 5, -3):
            batch.fill(1)
            batch.count.fill_(bad)
            out = layer.run(*batch.args(), *experts, streaming=True, num_tokens=batch.count)
            torch.cuda.synchronize()
            with pytest.raises(ChunkringInputError) as info:
                layer.check()
            record = info.value.record
            assert (record.field, record.source, record.shown_value()) == (InputField.VALID_TOKENS, runtime.rank, bad)
            layer.check()  # reported once
            n = MAX_TOKENS if bad > 0 else 0
            assert not bool(out[n:].any())
            if n:
                ref = layer_reference(layer, batch.x_in.to(out.device), batch.idx, batch.w, *reference)
                assert rel_error(out, ref) <= tolerance(layer)
    finally:
        layer.close()
