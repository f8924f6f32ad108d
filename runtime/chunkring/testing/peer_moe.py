"""The bench's peer baseline: the MoE layer's math written the plain-torch way, on one GPU.

``torch_moe`` is what a user without chunkring (and without any dispatch library) writes for the same
layer on a single rank: route, sort the (token, k) choices by expert, two grouped GEMMs with SwiGLU
between them, weight and scatter-add back. Activations stay bf16 (no FP8 payload: with every expert
local there is nothing to send, so nothing to shrink). The bench (:mod:`chunkring.testing.bench_moe`,
``chunkring-launch bench``) times it beside the layer (``peer_ms``) on one rank.

The multi-GPU peer (the same with an all-to-all over NCCL before and after the experts) needs one GPU
per rank; the bench's several ranks share one GPU under MPS, where NCCL cannot run, so it is not
written: it could not be run here.

It never reads a device value on the host (no ``.item()``, no ``.tolist()``, every shape fixed by the
inputs' shapes: n * K expert rows whatever the routing), so it can be captured in a CUDA graph, as the
bench times everything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chunkring.moe.routing import route

__all__ = ["torch_moe", "torch_moe_routed"]


def torch_moe(hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk: int) -> torch.Tensor:
    """bfloat16 [n, H]: out[t] = sum_k w[t, k] * w2[e] @ (silu(gate) * up), [gate, up] = w13[e] @ x[t].

    hidden: bfloat16 [n, H].  router_weight: bfloat16 [E, H].  w13: bfloat16 [E, 2I, H] (gate rows
    first, then up).  w2: bfloat16 [E, H, I].  Every expert is local (single rank).  On the GPU
    ``torch._grouped_mm`` (CUTLASS, sm90) wants 16-byte-aligned rows: H and I multiples of 8.
    """
    topk_idx, topk_weights = route(hidden, router_weight, topk)  # int32 [n, K], fp32 [n, K]
    return torch_moe_routed(hidden, topk_idx, topk_weights, w13, w2)


def torch_moe_routed(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor) -> torch.Tensor:
    """:func:`torch_moe` after its routing, on a routed batch (int32 ``topk_idx`` [n, K] in [0, E), fp32
    ``topk_weights`` [n, K]): the peer of :meth:`chunkring.MoELayer.run`, as :func:`torch_moe` is of
    :meth:`~chunkring.MoELayer.forward`."""
    n, h = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    topk = topk_idx.shape[1]

    # Sort the n * K choices by expert: each expert's rows become one contiguous group. Stable, so a
    # group keeps (token, k) order. Choice t * K + k is token t's.
    expert, order = torch.sort(topk_idx.reshape(-1), stable=True)
    token = order // topk
    rows = hidden.index_select(0, token)  # bf16 [n * K, H]
    weight = topk_weights.reshape(-1).index_select(0, order)

    # Group e ends where the sorted experts pass e. Not torch.bincount(...).cumsum(0): on CUDA bincount
    # reads the input's min and max back to the host (two stream syncs), which a graph cannot capture.
    # searchsorted gives the same int32 ends on the device; empty experts give empty groups.
    experts = torch.arange(num_experts, dtype=expert.dtype, device=expert.device)
    ends = torch.searchsorted(expert, experts, right=True, out_int32=True)

    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=ends)  # bf16 [n * K, 2I]
    gate, up = gate_up.float().split(inter, dim=1)
    act = (F.silu(gate) * up).to(torch.bfloat16)  # SwiGLU in fp32, back to bf16 for the next GEMM
    down = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)  # bf16 [n * K, H]

    # Weight and sum each token's K rows in fp32 (a token's rows lie in different groups).
    out = torch.zeros(n, h, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token, down.float() * weight.unsqueeze(1))
    return out.to(torch.bfloat16)
