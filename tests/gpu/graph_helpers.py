"""What the CUDA-graph tests on the GPU share (no tests here; tests/gpu/test_moe_graph.py says what they pin): a
layer of the graph tests' shape with its experts and the reference's weights, the captured call's inputs
(:class:`Batch`, rewritten in place before each replay), a capture in which any host synchronisation raises,
and one replay checked bit for bit against an eager call on the same layer (and, when given the reference's
weights, against the fp32 reference)."""

import torch

from chunkring import MoEConfig, MoELayer
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from tests.gpu.moe_helpers import H, layer_reference, local_weights, rel_error, routing, tolerance, weights

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
                    stream_slots=SLOTS, stream_slot_tokens=C)
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

