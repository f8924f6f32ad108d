"""What several MoE layer tests on the GPU share (no tests here): the shape (H, INTER), a case's inputs and
routing drawn from one seed, expert weights, this rank's experts of them, and the check against the fp32
reference - :func:`layer_reference` binds chunkring.testing.reference's moe_reference and
layer_weights_reference to a live layer, :func:`tolerance` is its reference_tolerance, :func:`rel_error`
the relative (Frobenius) error that never passes a NaN."""

import torch

from chunkring.moe.weights import expert_weights
from chunkring.testing.reference import (
    dequantize_fp8_per128,
    layer_weights_reference,
    moe_reference,
    quantize_fp8_per128,
    reference_tolerance,
)

H, INTER = 256, 128


def case_inputs(payload, n, num_experts, topk, mode, seed, device):
    """One rank's batch of a case: the reference's input (x as the layer sees it, on ``device``), routing
    (CPU), and :meth:`MoELayer.run`'s first four arguments on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x32 = torch.randn(n, H, generator=gen)
    idx, w = routing(n, num_experts, topk, mode, gen)
    if payload == "fp8":
        xq, sf = quantize_fp8_per128(x32)
        x_in = dequantize_fp8_per128(xq, sf)
    else:
        xq, sf = x32.to(torch.bfloat16), None
        x_in = xq.float()
    return x_in.to(device), idx, w, [t if t is None else t.to(device) for t in (xq, sf, idx, w)]


def routing(n, num_experts, topk, mode, gen):
    """int32 topk_idx [n, K] and float32 topk_weights [n, K]."""
    if mode == "one_expert":
        idx = torch.zeros(n, topk, dtype=torch.int64)  # duplicates: each (token, k) counts
    elif mode == "idle":  # two experts take everything, the rest idle
        idx = torch.randint(0, 2, (n, topk), generator=gen) * (num_experts - 1)
    else:
        idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :topk]
        if mode == "masked":
            idx[torch.rand(n, topk, generator=gen) < 0.3] = -1
    return idx.to(torch.int32), torch.rand(n, topk, generator=gen) + 0.1


def weights(num_experts, gen):
    w13 = (torch.randn(num_experts, 2 * INTER, H, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, H, INTER, generator=gen) / INTER**0.5).to(torch.bfloat16)
    return w13, w2


def local_weights(layer, w13, w2):
    """This rank's experts of every expert's w13 / w2 (CPU bfloat16), in the form the layer takes."""
    mine = slice(layer.first_expert, layer.first_expert + layer.experts_per_rank)
    device = layer.runtime.torch_device
    return expert_weights(layer.config, w13[mine].contiguous().to(device), w2[mine].contiguous().to(device))


def layer_reference(layer, x_in, idx, w, w13, w2):
    """The fp32 reference of the layer's math on ``x_in`` (the payload dequantised) with every expert's
    w13 / w2 (CPU bfloat16): the weights as the layer's GEMMs see them and, for the FP8 payload, the
    recipe's roundings between the GEMMs (bf16 L1 output, e4m3 SwiGLU output per 1x128). What remains is
    the bf16 rounding of L2's output and of the combine rows (2^-9 relative each) and fp32 accumulation
    order, which flips a few of the activation's e4m3 rounding decisions (:func:`tolerance`)."""
    device = x_in.device
    w13_ref, w2_ref = layer_weights_reference(w13, w2, layer.config.payload)
    return moe_reference(x_in, idx.to(device), w.to(device), w13_ref.to(device), w2_ref.to(device),
                         fp8_recipe=layer.config.payload.has_scales)


def tolerance(layer) -> float:
    """What :func:`layer_reference` allows for this layer's payload (reference_tolerance says why)."""
    return reference_tolerance(layer.config.payload)


def rel_error(out, ref):
    assert not bool(torch.isnan(out).any()), "NaN in the output (an unwritten row, or a NaN result)"
    if ref.numel() == 0:
        return 0.0
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))

