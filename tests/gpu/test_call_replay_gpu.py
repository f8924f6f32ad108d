"""Eager calls replayed from CUDA graphs (chunkring.moe._engine.replay) compute exactly what the same calls launched
kernel by kernel compute: two layers of one config - one replaying its eager calls (``eager_graphs=True``), one
launching every kernel (``eager_graphs=False``) - called alike, every output equal bit for bit, batch-ready and
streamed, through ``run()`` and ``forward()``, at sizes inside one bucket and across buckets, ranks bringing
different sizes, a call with a timeline (which runs directly) in between, a call into an output of the caller's, and
the replayed layer holding one graph per kind of call it saw - its routed calls' graphs rebound to each call's own
tensors (chunkring.moe._engine.rebind), each call's inputs at new addresses, then the same tensors twice with new
values (a replay that sets nothing). tests/unit/test_call_replay.py and tests/unit/test_rebind.py pin the bookkeeping
on the CPU."""

import logging

import pytest
import torch

from chunkring import MoEConfig, MoELayer, Timeline
from tests.gpu.moe_helpers import INTER, H, case_inputs, local_weights, weights

pytestmark = pytest.mark.gpu

#: Per step, rank r brings SIZES[(step + r) % len]: buckets 1, 4, 8, 64, 128, 256, some met twice.
SIZES = [1, 3, 4, 5, 33, 64, 100, 256, 7, 2]


@pytest.mark.parametrize("payload", ["fp8", "bf16"])
def test_replayed_eager_calls_equal_launched_calls_bit_for_bit(runtime, payload, caplog):
    caplog.set_level(logging.INFO, logger="chunkring")  # why a graph copies, should one
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=8 * W, hidden=H, intermediate=INTER, topk=4, max_tokens_per_rank=256,
                    payload=payload, stream_slots=2, stream_slot_tokens=32)
    replayed, launched = MoELayer(runtime, cfg, eager_graphs=True), MoELayer(runtime, cfg, eager_graphs=False)
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(21))
        experts = {layer: local_weights(layer, w13, w2) for layer in (replayed, launched)}
        router = (torch.randn(cfg.num_experts, H, generator=torch.Generator().manual_seed(22)) / 16).to(
            torch.bfloat16).to(device)
        for step in range(2 * len(SIZES)):
            n = SIZES[(step + rank) % len(SIZES)]
            streaming = step % 2 == 1
            _, _, _, args = case_inputs(payload, n, cfg.num_experts, cfg.topk, "uniform", 100 * step + rank, device)
            hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(step), device="cpu").to(
                torch.bfloat16).to(device)
            timeline = Timeline(device) if step == 7 else None  # runs directly: the replays around it still match
            outs = {}
            for layer in (replayed, launched):
                out = torch.full((n, H), float("nan"), dtype=torch.bfloat16, device=device) if step % 3 == 2 else None
                ran = layer.run(*args, *experts[layer], streaming=streaming, timeline=timeline, out=out)
                assert out is None or ran is out
                forwarded = layer.forward(hidden, router, *experts[layer], streaming=streaming)
                outs[layer] = (ran, forwarded)
            torch.cuda.synchronize()
            for layer in (replayed, launched):
                layer.check()
            for got, want in zip(outs[replayed], outs[launched], strict=True):
                assert got.shape == (n, H) and torch.equal(got, want), f"step {step}, {n} rows"
        # The same tensors call after call, their values rewritten in between: a replay that sets no node and writes
        # no count (both as the last call left them) reads the new values.
        _, _, _, args = case_inputs(payload, 5, cfg.num_experts, cfg.topk, "uniform", 7, device)
        for seed in (8, 9, 10):  # the first may run directly and capture: two replays follow
            outs = [layer.run(*args, *experts[layer]) for layer in (replayed, launched)]
            torch.cuda.synchronize()
            assert torch.equal(*outs), f"the same tensors, seed {seed}"
            _, _, _, fresh = case_inputs(payload, 5, cfg.num_experts, cfg.topk, "uniform", seed, device)
            for tensor, values in zip(args, fresh, strict=True):
                if tensor is not None:
                    tensor.copy_(values)
        # One graph per kind seen: run and forward, both modes, each bucket this rank met.
        stats = replayed.stats()
        assert stats["call_graphs"] >= 4 and launched.stats()["call_graphs"] == 0
        # Every batch-ready run() graph (one chunk) is rebound; forward()'s copy (its router reads the rows).
        assert 1 <= stats["call_graphs_rebound"] < stats["call_graphs"], (stats, caplog.text[-3000:])
    finally:
        replayed.close()
        launched.close()
