"""The owner's reduction over k on the GPU: it adds only the choices its own pull found routed, each written once
in the call by the rank that owns its expert, so nothing zeroes the combine buffer (docs/PROTOCOL.md, "The MoE
layer on the ring"). The negative control: a reduction that adds every choice's row takes what an earlier call
left in a masked choice's row."""

import pytest
import torch

from chunkring import MoEConfig
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from chunkring.testing.variants import mutant_layer
from tests.gpu.moe_helpers import INTER, H, layer_reference, local_weights, rel_error, routing, tolerance, weights

pytestmark = pytest.mark.gpu


def _masked_after_routed_is_wrong(runtime, variant: int) -> bool:
    """A layer of ``variant``'s kernels (0: the real ones), two batch-ready calls of the same tokens: every choice
    routed, then about 30 % of them masked. Nothing zeroes the combine buffer, so each masked choice's row still
    holds the first call's value. Whether any rank's second output missed the reference."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=4, max_tokens_per_rank=64)
    layer = mutant_layer(runtime, cfg, variant, timeout_s=60)
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(11))
        w13_local, w2_local = local_weights(layer, w13, w2)
        gen = torch.Generator().manual_seed(40 + rank)
        xq, sf = quantize_fp8_per128(torch.randn(64, H, generator=gen))
        routed, w = routing(64, cfg.num_experts, cfg.topk, "uniform", gen)
        masked = routed.clone()
        masked[torch.rand(64, cfg.topk, generator=gen) < 0.3] = -1
        outs = [layer.run(*(t.to(device) for t in (xq, sf, idx, w)), w13_local, w2_local) for idx in (routed, masked)]
        torch.cuda.synchronize()
        layer.check()
        ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), masked, w, w13, w2)
        wrong = rel_error(outs[1], ref) > tolerance(layer)
    finally:
        layer.destroy()
    return any(runtime.allgather_object(wrong))


def test_negative_control_a_reduction_of_every_choice_adds_rows_no_rank_wrote(runtime):
    """The owner's reduction adds only its routed choices' combine rows (docs/PROTOCOL.md, "The MoE layer on the
    ring"): a masked choice's row is written by no rank and never zeroed. The REDUCE_EVERY_CHOICE mutant adds
    every row, so after a call that routed every choice, a call that masks some adds the first call's rows and
    misses the reference; the real kernels, same calls, match it. One rank suffices: its own rows."""
    from chunkring.testing.stress import REDUCE_EVERY_CHOICE

    assert not _masked_after_routed_is_wrong(runtime, 0)
    assert _masked_after_routed_is_wrong(runtime, REDUCE_EVERY_CHOICE), \
        "the REDUCE_EVERY_CHOICE mutant escaped: the reduction's routing is not what keeps stale rows out"
