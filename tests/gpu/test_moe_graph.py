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

from chunkring import MoEConfig, MoELayer
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from tests.gpu.test_moe_layer import H, layer_reference, local_weights, rel_error, routing, tolerance, weights

pytestmark = pytest.mark.gpu

REPLAYS = 1000
C, SLOTS, MAX_TOKENS, TOPK = 16, 2, 72, 2  # up to five chunks through a two-slot ring: it wraps inside a call


class Batch:
    """The captured call's inputs, written in place before each replay."""

    def __init__(self, runtime, cfg):
        device = runtime.torch_device
        self.x = torch.zeros(MAX_TOKENS, H, dtype=torch.float8_e4m3fn, device=device)
        self.sf = torch.zeros(MAX_TOKENS, H // 128, device=device)
        self.idx = torch.zeros(MAX_TOKENS, TOPK, dtype=torch.int32, device=device)
        self.w = torch.zeros(MAX_TOKENS, TOPK, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.cfg, self.rank, self.world = cfg, runtime.rank, runtime.world_size
        self.x_in = None  # the dequantised input of the last fill, for the reference

    def fill(self, step: int) -> int:
        """Fresh inputs for ``step``; returns this rank's real token count."""
        gen = torch.Generator().manual_seed(1_000_003 * step + self.rank)
        n = 0 if (step + self.rank) % 7 == 0 else int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen))
        xq, sf = quantize_fp8_per128(torch.randn(MAX_TOKENS, H, generator=gen))
        idx, w = routing(MAX_TOKENS, self.cfg.num_experts, TOPK, "masked" if step % 3 else "uniform", gen)
        for dst, src in ((self.x, xq), (self.sf, sf), (self.idx, idx), (self.w, w)):
            dst.copy_(src)
        self.count.fill_(n)
        self.x_in = dequantize_fp8_per128(xq, sf)
        return n

    def args(self):
        return self.x, self.sf, self.idx, self.w


def make_layer(runtime):
    W = runtime.world_size
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=128, topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                    front_num_slots=SLOTS, front_tokens_per_slot=C)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(5))
    return layer, local_weights(layer, w13, w2), (w13, w2)


def strict_capture(call):
    """``call()`` captured into a CUDA graph, any host synchronisation inside it raising; (graph, its result)."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph, capture_error_mode="global"):
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, result


def capture(layer, batch, experts, out, *, streaming):
    """One eager warm-up call, then the captured call; any host synchronisation inside raises."""
    def call():
        return layer.run(*batch.args(), *experts, streaming=streaming, out=out, num_tokens=batch.count)

    call()
    torch.cuda.synchronize()
    return strict_capture(call)[0]


def check_replay(layer, batch, experts, graph, out, step, *, streaming, reference=None):
    n = batch.fill(step)
    graph.replay()
    replayed = out.clone()
    eager = layer.run(*batch.args(), *experts, streaming=streaming, num_tokens=batch.count)
    torch.cuda.synchronize()
    layer.check()
    assert torch.equal(replayed, eager), f"replay {step} (n={n}) differs from the eager call"
    assert not bool(replayed[n:].any()), f"replay {step}: rows past the real count {n} are not zero"
    if reference is not None:
        ref = layer_reference(layer, batch.x_in[:n].to(out.device), batch.idx[:n], batch.w[:n], *reference)
        assert rel_error(replayed[:n], ref) <= tolerance(layer), f"replay {step}"


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
        layer.destroy()


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
        layer.destroy()


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
        layer.destroy()
