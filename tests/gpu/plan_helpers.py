"""What the GPU tests of the decode-sized expert paths on one plan share (no tests here; tests/gpu/test_moe_decode.py
and test_moe_persistent.py say what they pin): one rank's staged tokens as moe_pull leaves them, routed among the
first :data:`ACTIVE` of :data:`E_LOCAL` experts (the rest never have rows), FP8 expert weights, and the fp32 reference
of the recipe on the plan's real rows."""

import torch

from chunkring.moe._engine.stage import Stage
from chunkring.moe.weights import quantize_weight_fp8
from chunkring.testing.reference import dequantize_fp8_per128, plan_reference, quantize_fp8_per128

E_LOCAL, TOPK, INTER = 8, 4, 2048
ACTIVE = 6  # tokens choose among experts 0..5: experts 6 and 7 never have rows


def staged(n, hidden, device, seed):
    """What moe_pull leaves for one rank of one: n tokens' FP8 rows and routing; and their dequantised rows."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(n, ACTIVE, generator=gen).argsort(dim=1)[:, :TOPK].to(torch.int32)
    w = torch.rand(n, TOPK, generator=gen) + 0.1
    xq, sf = quantize_fp8_per128(torch.randn(n, hidden, generator=gen) * 3)
    stage = Stage(xq[None].to(device), sf[None].to(device), idx[None].to(device), w[None].to(device), expert_lo=0,
                  expert_hi=E_LOCAL)
    return stage, dequantize_fp8_per128(xq, sf).to(device)


def expert_weights_fp8(hidden, device, seed):
    """The :data:`E_LOCAL` experts' w13 and w2, drawn on ``device`` and quantised (Fp8Weight each)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    w13 = torch.randn(E_LOCAL, 2 * INTER, hidden, generator=gen, device=device) / hidden**0.5
    w2 = torch.randn(E_LOCAL, hidden, INTER, generator=gen, device=device) / INTER**0.5
    return quantize_weight_fp8(w13), quantize_weight_fp8(w2)


def dequantized(q, e):
    """float32 [N, K] of expert e of an Fp8Weight (one expert at a time: all of them would not fit twice)."""
    scale = q.scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
    return q.data[e].float() * scale[:q.data.shape[1], :q.data.shape[2]]


def reference(plan, x_in, q13, q2):
    """The plan's real rows (in plan order), and for them fp32 outputs [rows, H] and the dequantised activation
    (:func:`chunkring.testing.reference.plan_reference`, the weights in fp32)."""
    return plan_reference(plan, x_in, lambda e: dequantized(q13, e), lambda e: dequantized(q2, e))
