"""The owner's reduction over k on the GPU: it adds only the choices its own pull found routed, each written once
in the call by the rank that owns its expert (or, for this rank's own experts, left where its L2 wrote them), so
nothing zeroes the combine buffer (docs/PROTOCOL.md, "The MoE layer on the ring"). The negative control: a
reduction that adds every choice's row reads rows no rank wrote. And a call whose drain gave up returns zeros, never
the rows an earlier call left (its negative control sums them)."""

import pytest
import torch

from chunkring import MoEConfig
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from chunkring.testing.variants import mutant_layer
from tests.gpu.moe_helpers import INTER, H, layer_reference, local_weights, rel_error, routing, tolerance, weights

pytestmark = pytest.mark.gpu


def _masked_choices_read(runtime, variant: int) -> bool:
    """A layer of ``variant``'s kernels (0: the real ones), its combine buffer filled with NaN - what no push writes
    - then one batch-ready call with about 30 % of the choices masked. Whether any rank's output missed the
    reference (a NaN row read makes its tokens NaN)."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=8 * W, hidden=H, intermediate=INTER, topk=4, max_tokens_per_rank=64)
    layer = mutant_layer(runtime, cfg, variant, timeout_s=60)
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(11))
        w13_local, w2_local = local_weights(layer, w13, w2)
        gen = torch.Generator().manual_seed(40 + rank)
        xq, sf = quantize_fp8_per128(torch.randn(64, H, generator=gen))
        idx, w = routing(64, cfg.num_experts, cfg.topk, "uniform", gen)
        idx[torch.rand(64, cfg.topk, generator=gen) < 0.3] = -1
        # Stream-ordered before the call's publish, so before any peer pulls this rank's tokens and pushes to it.
        layer.resources.combine.fill_(float("nan"))
        out = layer.run(*(t.to(device) for t in (xq, sf, idx, w)), w13_local, w2_local)
        torch.cuda.synchronize()
        layer.check()
        ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), idx, w, w13, w2)
        wrong = not torch.isfinite(out).all() or rel_error(out, ref) > tolerance(layer)
    finally:
        layer.close()
    return any(runtime.allgather_object(bool(wrong)))


def test_negative_control_a_reduction_of_every_choice_adds_rows_no_rank_wrote(runtime):
    """The owner's reduction adds only its routed choices' rows (docs/PROTOCOL.md, "The MoE layer on the ring"): a
    masked choice's combine row is written by no rank and never zeroed. The REDUCE_EVERY_CHOICE mutant adds every
    row, so with the combine buffer holding NaN it reads a masked choice's NaN and misses the reference; the real
    kernels, same call, match it. One rank suffices: its own masked choices."""
    from chunkring.testing.stress import REDUCE_EVERY_CHOICE

    assert not _masked_choices_read(runtime, 0)
    assert _masked_choices_read(runtime, REDUCE_EVERY_CHOICE), \
        "the REDUCE_EVERY_CHOICE mutant escaped: the reduction's routing is not what keeps unwritten rows out"


def _failed_call_outputs(runtime, variant: int) -> list[str]:
    """A layer of ``variant``'s kernels: one clean call, then the same call again while the last rank stays away, on a
    one-second watchdog. What each other rank's second output was: "zeros", "stale" (the first call's, bit for bit:
    the rows the first call left) or "other"."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=8 * W, hidden=H, intermediate=INTER, topk=4, max_tokens_per_rank=64)
    layer = mutant_layer(runtime, cfg, variant, timeout_s=60)
    verdict = "away"
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(12))
        experts = local_weights(layer, w13, w2)
        gen = torch.Generator().manual_seed(60 + rank)
        xq, sf = quantize_fp8_per128(torch.randn(64, H, generator=gen))
        idx, w = routing(64, cfg.num_experts, cfg.topk, "uniform", gen)
        batch = [t.to(device) for t in (xq, sf, idx, w)]
        first = layer.run(*batch, *experts)
        torch.cuda.synchronize()
        layer.check()
        assert bool(first.any())
        layer.set_timeout(1.0)
        if rank != W - 1:  # the last rank never makes the second call: every other rank's drain gives up
            second = layer.run(*batch, *experts)
            torch.cuda.synchronize()
            verdict = "zeros" if not second.any() else "stale" if torch.equal(second, first) else "other"
        runtime.host_barrier(timeout_s=60, what="the end of the failed call")
        layer.reset()
        layer.set_timeout(60.0)
    finally:
        layer.close()
    return runtime.allgather_object(verdict)


def test_a_failed_call_returns_zeros_never_the_rows_an_earlier_call_left(runtime):
    """docs/INTEGRATION.md, "Failing closed": a call whose kernels gave up returns zeros. At two or more ranks a rank
    that stays away makes every other rank's drain give up; their combine buffers still hold the first call's rows
    for their tokens, which the REDUCE_AFTER_ERROR mutant sums into a plausible, wrong output (here the first
    call's, bit for bit); the real reduction returns zeros."""
    from chunkring.testing.stress import REDUCE_AFTER_ERROR

    if runtime.world_size < 2:
        pytest.skip("a drain gives up on a peer that stays away: needs two ranks")
    assert set(_failed_call_outputs(runtime, 0)[:-1]) == {"zeros"}
    assert "stale" in _failed_call_outputs(runtime, REDUCE_AFTER_ERROR)[:-1], \
        "the REDUCE_AFTER_ERROR mutant escaped: nothing shows what keeps stale rows out of a failed call"
