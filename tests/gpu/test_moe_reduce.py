"""The owner's reduction over k on the GPU: it adds only the choices its own pull found routed, each written once
in the call by the rank that owns its expert (or, for this rank's own experts, left where its L2 wrote them), so
nothing zeroes the combine buffer (docs/PROTOCOL.md, "The MoE layer on the ring"). The negative control: a
reduction that adds every choice's row reads rows no rank wrote."""

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
        layer.destroy()
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
