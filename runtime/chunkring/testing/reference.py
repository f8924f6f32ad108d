"""An fp32 reference of the MoE layer's math and of the FP8 payload's per-128-channel quantisation.

This is what the device path is checked against, so it is written for clarity, not speed: plain fp32
torch ops, vectorised over the tokens of each expert (one loop over experts, none over tokens).

The FP8 payload (``PayloadFormat.FP8_E4M3``): ``x ≈ x_fp8 * x_sf`` per block of 128 channels, with the
block's absmax mapped to e4m3's largest finite value, 448.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from chunkring.errors import ChunkringUsageError
from chunkring.moe.routing import E4M3_MAX, quantize_rows_fp8
from chunkring.moe.weights import quantize_weight_fp8
from chunkring.ring.spec import FP8_SCALE_BLOCK, PayloadFormat

__all__ = [
    "E4M3_MAX",
    "dequantize_fp8_per128",
    "layer_weights_reference",
    "moe_reference",
    "plan_reference",
    "reference_tolerance",
    "quantize_fp8_per128",
]


def quantize_fp8_per128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows to FP8 e4m3 with one fp32 scale per 128 channels.

    x: float32 or bfloat16 [N, H], H a multiple of 128, finite.
    Returns x_fp8: float8_e4m3fn [N, H] and x_sf: float32 [N, H / 128], with x ≈ x_fp8 * x_sf.
    A block of zeros gets scale 1 (any scale would do; 1 keeps x_sf finite and the block exactly 0).
    A block whose absmax / 448 underflows fp32 (absmax < ~6e-43) is treated like a zero block.
    """
    _check_matrix("x", x, (torch.float32, torch.bfloat16))
    n, h = x.shape
    if h % FP8_SCALE_BLOCK:
        raise ChunkringUsageError(f"H = {h} must be a multiple of {FP8_SCALE_BLOCK} (one scale per block)", field="x")
    if not bool(torch.isfinite(x).all()):
        raise ChunkringUsageError("must be finite (an inf or NaN has no e4m3 scale)", field="x")
    return quantize_rows_fp8(x)


def dequantize_fp8_per128(x_fp8: torch.Tensor, x_sf: torch.Tensor) -> torch.Tensor:
    """float32 [N, H] = x_fp8 (float8_e4m3fn [N, H]) * x_sf (float32 [N, H / 128]) per 128-channel block."""
    _check_matrix("x_fp8", x_fp8, (torch.float8_e4m3fn,))
    _check_matrix("x_sf", x_sf, (torch.float32,))
    n, h = x_fp8.shape
    if h % FP8_SCALE_BLOCK or tuple(x_sf.shape) != (n, h // FP8_SCALE_BLOCK):
        raise ChunkringUsageError(f"need shape [{n}, {h} / {FP8_SCALE_BLOCK}] for x_fp8 of shape [{n}, {h}], "
                                  f"got {tuple(x_sf.shape)}", field="x_sf")
    blocks = x_fp8.to(torch.float32).reshape(n, h // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
    return (blocks * x_sf.unsqueeze(-1)).reshape(n, h)


def moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, *, fp8_recipe: bool = False) -> torch.Tensor:
    """float32 [N, H]: out[t] = sum_k w[t, k] * w2[e] @ (silu(gate) * up), [gate, up] = split(w13[e] @ x[t], I).

    ``fp8_recipe``: the roundings the FP8 layer makes between its GEMMs - L1's output ``[gate, up]`` to
    bf16 (the GEMM's output type), then ``silu(gate) * up`` quantised to FP8 e4m3 per 1x128 - so the
    layer is held to accumulation-order differences only (its FP8 rows and weights are passed here
    already dequantised). Without the bf16 step, the activation's e4m3 rounding decisions that bf16 moves
    alone put the layer ~1.4 % from this reference.

    x: float32 [N, H].  topk_idx: int32 [N, K], e = topk_idx[t, k] in [-1, E), -1 = masked (adds nothing,
    whatever its weight).  topk_weights: float32 [N, K].  w13: float32 [E, 2I, H] (gate rows first, then
    up).  w2: float32 [E, H, I].  A token whose choices are all masked gets zeros.
    Each token's terms are added in ascending expert order (a token naming one expert twice gets both).
    """
    _check_matrix("x", x, (torch.float32,))
    _check_matrix("topk_idx", topk_idx, (torch.int32,))
    _check_matrix("topk_weights", topk_weights, (torch.float32,))
    for name, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 3:
            raise ChunkringUsageError(f"must be a float32 tensor with 3 dims, got "
                                      f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}",
                                      field=name)
    n, h = x.shape
    num_experts, two_i, w13_h = w13.shape
    if w13_h != h or two_i % 2 or two_i == 0:
        raise ChunkringUsageError(f"need shape [E, 2I, {h}] with I >= 1, got {tuple(w13.shape)}", field="w13")
    inter = two_i // 2
    if tuple(w2.shape) != (num_experts, h, inter):
        raise ChunkringUsageError(f"need shape [{num_experts}, {h}, {inter}], got {tuple(w2.shape)}", field="w2")
    if topk_idx.shape[0] != n:
        raise ChunkringUsageError(f"has {topk_idx.shape[0]} rows, x has {n}", field="topk_idx")
    if topk_weights.shape != topk_idx.shape:
        raise ChunkringUsageError(f"shape {tuple(topk_weights.shape)} != topk_idx shape {tuple(topk_idx.shape)}",
                                  field="topk_weights")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        if t.device != x.device:
            raise ChunkringUsageError(f"on {t.device}, x on {x.device}", field=name)
    if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
        raise ChunkringUsageError(f"expert indices must be in [-1, {num_experts}), got "
                                  f"[{int(topk_idx.min())}, {int(topk_idx.max())}]", field="topk_idx")

    k = topk_idx.shape[1]
    expert = topk_idx.reshape(-1).to(torch.int64)
    token = torch.arange(n, device=x.device).repeat_interleave(k)
    weight = topk_weights.reshape(-1)
    live = expert >= 0
    expert, token, weight = expert[live], token[live], weight[live]
    # Stable sort: each expert's rows stay in (token, k) order, so the sum order is fixed.
    expert, order = torch.sort(expert, stable=True)
    token, weight = token[order], weight[order]
    counts = torch.bincount(expert, minlength=num_experts).tolist()

    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token[start:start + count]
        gate_up = x[rows] @ w13[e].T  # [count, 2I]
        if fp8_recipe:
            gate_up = gate_up.to(torch.bfloat16).float()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [count, I]
        if fp8_recipe:
            act = dequantize_fp8_per128(*quantize_fp8_per128(act))
        out.index_add_(0, rows, (act @ w2[e].T) * weight[start:start + count, None])
        start += count
    return out


def plan_reference(plan: Any, x: torch.Tensor, w13: Callable[[int], torch.Tensor],
                   w2: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert work on a plan under the FP8 recipe's roundings (L1's output to bf16, the activation to e4m3 per
    1x128), one expert at a time: (the plan's real rows in plan order, their outputs [rows, H], their dequantised
    activations [rows, I]). ``plan``: its ``counts``, ``group_end`` and ``token`` (a plan of
    :class:`chunkring.moe._engine.experts.ExpertCompute`); ``x``: the dequantised rows by token; ``w13(e)`` /
    ``w2(e)``: expert e's dequantised weights, [2I, H] / [H, I], in the precision the caller wants the GEMMs in."""
    ends, counts = plan.group_end.tolist(), plan.counts.tolist()
    rows, outs, acts = [], [], []
    for e, (end, count) in enumerate(zip(ends, counts, strict=True)):
        if count:
            real = torch.arange(end - count, end, device=x.device)
            up_rows = w13(e)
            gate_up = (x[plan.token[real].long()].to(up_rows.dtype) @ up_rows.t()).to(torch.bfloat16).float()
            inter = gate_up.shape[1] // 2
            act = dequantize_fp8_per128(*quantize_fp8_per128(F.silu(gate_up[:, :inter]) * gate_up[:, inter:]))
            down = w2(e)
            rows.append(real)
            acts.append(act)
            outs.append(act.to(down.dtype) @ down.t())
    return torch.cat(rows), torch.cat(outs), torch.cat(acts)


def reference_tolerance(payload: PayloadFormat) -> float:
    """The relative (Frobenius) error a layer's output may have against :func:`moe_reference` on its
    dequantised inputs and :func:`layer_weights_reference` weights (``fp8_recipe`` for the FP8 payload).

    bf16 payload: 1e-2 - bf16 rounding of the GEMMs' outputs, the activation and the combine rows (2^-9
    relative each) and accumulation order, measured 0.3-0.5 %.
    FP8 payload: 4e-2. The reference applies the recipe's roundings, but not the GEMM's accumulation
    order: L1's output differs from it by ~1e-3 relative, which flips the e4m3 rounding of the activation
    wherever a value lies that close to a rounding boundary, and each flip moves an element by one e4m3
    step, 2^-3 of its binade. The flips are few, so their sum varies most on small outputs: on the
    fuzz test's shape (28 tokens, H=256, I=128) L1 noise of 1e-3 (2e-3) gives a mean of 1.4 % (1.8 %),
    p99 1.9 % (2.4 %), max 2.0 % (2.7 %) over 400 draws (a CPU simulation of the recipe); the H200
    measured 0.5-1.4 % on the layer tests and up to 2.5 % in the fuzz test. A lost or
    misplaced row of those outputs moves it by more than 6 %, a dropped scale block by more.
    """
    return 4e-2 if payload.has_scales else 1e-2


def layer_weights_reference(w13: torch.Tensor, w2: torch.Tensor,
                            payload: PayloadFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 w13, w2 as the layer's GEMMs see them for ``payload``: FP8 -> quantised per 128x128 block
    (:func:`chunkring.moe.quantize_weight_fp8`, what :func:`chunkring.expert_weights` does) and dequantised;
    bf16 -> as given."""
    if payload.has_scales:
        return quantize_weight_fp8(w13).dequantize(), quantize_weight_fp8(w2).dequantize()
    return w13.float(), w2.float()


def _check_matrix(field: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ChunkringUsageError(f"must be a torch.Tensor, got {type(t).__name__}", field=field)
    if t.dtype not in dtypes:
        raise ChunkringUsageError(f"dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}", field=field)
    if t.dim() != 2:
        raise ChunkringUsageError(f"must have 2 dims, got shape {tuple(t.shape)}", field=field)
