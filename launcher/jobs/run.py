"""One MoE workload: the layer batch-ready and streamed on the same inputs, each checked against the
fp32 reference of the same math, then timed.

Every rank routes its own ``tokens_per_rank`` tokens (seeded per rank) through the layer's producers
(router GEMM -> TopK -> FP8 quantisation -> publish). Fails when either mode's relative error against
the reference exceeds ``tolerance``; reports both errors, the median time per call of each mode, and
the symmetric memory of the full input region against the streaming ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError


@dataclass(frozen=True)
class CONFIG:
    num_experts: int = 16
    hidden: int = 1024
    intermediate: int = 512
    topk: int = 4
    tokens_per_rank: int = 512
    max_tokens_per_rank: int = 512
    payload: str = "fp8"
    front_num_slots: int = 2
    front_tokens_per_slot: int = 128
    iterations: int = 20
    warmup: int = 3
    tolerance: float = 1e-2
    seed: int = 0

    def __post_init__(self):
        if self.payload not in ("fp8", "bf16"):
            raise ChunkringUsageError(f"must be 'fp8' or 'bf16', got {self.payload!r}", field="payload")
        if not 0 <= self.tokens_per_rank <= self.max_tokens_per_rank:
            raise ChunkringUsageError(f"must be in [0, max_tokens_per_rank={self.max_tokens_per_rank}]",
                                      field="tokens_per_rank")
        for name in ("iterations", "warmup"):
            if not 1 <= getattr(self, name) <= 100_000:
                raise ChunkringUsageError("must be in [1, 100000]", field=name)
        if not 0 < self.tolerance < 1:
            raise ChunkringUsageError("must be in (0, 1)", field="tolerance")
        self.layer_config()  # the layer's own checks, before any rank starts GPU work

    def layer_config(self):
        from chunkring import MoEConfig, PayloadFormat

        return MoEConfig(num_experts=self.num_experts, hidden=self.hidden, intermediate=self.intermediate,
                         topk=self.topk, max_tokens_per_rank=self.max_tokens_per_rank,
                         payload=PayloadFormat.FP8_E4M3 if self.payload == "fp8" else PayloadFormat.BF16,
                         front_num_slots=self.front_num_slots, front_tokens_per_slot=self.front_tokens_per_slot)


def run(runtime, config: CONFIG) -> dict:
    """Check and time the layer on this rank; returns this rank's figures."""
    import torch

    from chunkring import ChunkedMoE, MoELayer
    from chunkring.moe_layer import init_weights
    from chunkring.moe_producer import route
    from chunkring.moe_reference import dequantize_fp8_per128, moe_reference, quantize_fp8_per128

    cfg = config.layer_config()
    device = runtime.torch_device
    layer = MoELayer(runtime, cfg)
    try:
        module = ChunkedMoE(layer, generator=torch.Generator().manual_seed(config.seed))
        _, w13, w2 = init_weights(cfg, torch.Generator().manual_seed(config.seed))
        gen = torch.Generator().manual_seed(config.seed * 1000 + 1 + runtime.rank)
        hidden = torch.randn(config.tokens_per_rank, cfg.hidden, generator=gen).to(torch.bfloat16).to(device)

        idx, weights = route(hidden, module.router_weight, cfg.topk)
        x_in = dequantize_fp8_per128(*quantize_fp8_per128(hidden.float())) if config.payload == "fp8" else hidden.float()
        ref = moe_reference(x_in, idx, weights, w13.float().to(device), w2.float().to(device))
        figures = {}
        for mode, streaming in (("batch", False), ("streamed", True)):
            out = module(hidden, streaming=streaming)
            torch.cuda.synchronize()
            layer.check()
            if bool(torch.isnan(out).any()):
                raise ChunkringRuntimeError(f"rank {runtime.rank}: {mode} output holds NaN")
            err = float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)) if ref.numel() else 0.0
            if err > config.tolerance:
                raise ChunkringRuntimeError(f"rank {runtime.rank}: {mode} relative error {err:.3e} > {config.tolerance}")
            figures[f"{mode}_rel_error"] = err
            figures[f"{mode}_ms"] = _median_ms(lambda s=streaming: module(hidden, streaming=s), runtime, config)
        layer.check()
        figures["streamed_over_batch"] = figures["streamed_ms"] / figures["batch_ms"]
        memory = layer.memory()
        figures["full_input_region_MiB"] = memory["full_input_region_bytes"] / 2**20
        figures["streaming_ring_MiB"] = memory["streaming_ring_bytes"] / 2**20
        return figures
    finally:
        torch.cuda.synchronize()
        runtime.barrier()
        layer.destroy()


def _median_ms(call, runtime, config: CONFIG) -> float:
    """Median over ``iterations`` calls of one call's time, ranks started together for each."""
    import statistics

    import torch

    for _ in range(config.warmup):
        call()
    times = []
    for _ in range(config.iterations):
        torch.cuda.synchronize()
        runtime.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
