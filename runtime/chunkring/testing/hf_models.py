"""Tiny random Hugging Face MoE models for the drop-in block's tests (no download: configs built here).

Unless overridden, both have H = 256, I = 128 (``moe_intermediate_size``), 8 routed experts, top-2, a 128-token
vocabulary: shapes every payload takes (multiples of 128) and whose experts split over 1, 2, 4 and 8 ranks.
Qwen3-MoE: 2 layers, both MoE. DeepSeek-V3: 3 layers, the first dense (``first_k_dense_replace`` = 1),
then 2 MoE layers with group-limited routing (4 groups, 2 chosen), one shared expert and a routed scaling
factor of 2.5. Every router, and DeepSeek-V3's score-correction bias, is drawn from the seed (transformers
may leave a router at zero), scaled so that top-k choices are clear-cut rather than near-ties.

The same builders make a benchmark's model of real shapes (``overrides``, ``device=``: built on the GPU in bf16,
benchmarks/bench_model.py), and :func:`block_reference` is chunkring's fp32 reference of a drop-in block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chunkring.integrations.transformers import route
from chunkring.ring.spec import PayloadFormat
from chunkring.testing.reference import (
    dequantize_fp8_per128,
    layer_weights_reference,
    moe_reference,
    quantize_fp8_per128,
)

__all__ = ["ARCHITECTURES", "block_reference", "tiny_config", "tiny_model"]

ARCHITECTURES = ("qwen3_moe", "deepseek_v3")

_COMMON: dict[str, Any] = {"vocab_size": 128, "hidden_size": 256, "intermediate_size": 512,
                           "moe_intermediate_size": 128, "num_experts_per_tok": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 4, "max_position_embeddings": 128, "hidden_act": "silu",
                           "tie_word_embeddings": False}


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """The tiny config of ``architecture`` ("qwen3_moe" or "deepseek_v3"), ``overrides`` applied."""
    if architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        fields = {**_COMMON, "num_hidden_layers": 2, "num_experts": 8, "head_dim": 64, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": []}
        return Qwen3MoeConfig(**{**fields, **overrides})
    if architecture == "deepseek_v3":
        from transformers import DeepseekV3Config

        fields = {**_COMMON, "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
                  "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                  "norm_topk_prob": True, "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16,
                  "qk_nope_head_dim": 32, "v_head_dim": 32}
        return DeepseekV3Config(**{**fields, **overrides})
    raise ValueError(f"unknown architecture {architecture!r} (one of {ARCHITECTURES})")


def tiny_model(architecture: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str | None = None, **overrides: Any) -> nn.Module:
    """A ``*ForCausalLM`` of :func:`tiny_config` in eval mode, in ``dtype``, its weights drawn from ``seed``
    (routers and DeepSeek-V3's correction bias redrawn here, see the module docstring). By default on the CPU,
    drawn in float32 and cast; with ``device``, built there in ``dtype`` from the start (no float32 copy: a
    model of several GB), its draws from that device's generator - the same model on every rank of one GPU
    type."""
    config = tiny_config(architecture, **overrides)
    if architecture == "qwen3_moe":
        from transformers import Qwen3MoeForCausalLM as model_class
    else:
        from transformers import DeepseekV3ForCausalLM as model_class
    torch.manual_seed(seed)
    if device is None:
        model = model_class(config)
    else:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = model_class(config)
        finally:
            torch.set_default_dtype(default_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                weight = module.weight
                weight.copy_(torch.randn(weight.shape, generator=gen) * 3.0 / weight.shape[1] ** 0.5)
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(torch.rand(bias.shape, generator=gen) * 0.1)
    return model.to(dtype).eval()


def block_reference(block: nn.Module, hidden: torch.Tensor, payload: PayloadFormat) -> torch.Tensor:
    """float32 [n, H]: chunkring's fp32 reference of what the drop-in block computes in the place of the
    transformers MoE ``block`` from ``hidden`` [..., H] (n rows): the block's own routing (:func:`route`), its
    experts' weights as ``payload`` carries them (:func:`layer_weights_reference`), the rows likewise (FP8: per
    1x128, dequantised), the FP8 recipe's roundings (:func:`moe_reference`), plus the block's shared experts
    (DeepSeek-V3) as it adds them. Runs where the block lives; the layer's output is held to
    :func:`~chunkring.testing.reference.reference_tolerance` of it."""
    fp8 = payload.has_scales
    rows = hidden.reshape(-1, hidden.shape[-1])
    topk_idx, topk_weights = route(block, rows)
    experts = block.get_submodule("experts")
    w13, w2 = layer_weights_reference(experts.get_parameter("gate_up_proj").detach(),
                                      experts.get_parameter("down_proj").detach(), payload)
    x = dequantize_fp8_per128(*quantize_fp8_per128(rows.float())) if fp8 else rows.float()
    out = moe_reference(x, topk_idx, topk_weights, w13, w2, fp8_recipe=fp8)
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        out = out + shared(hidden).reshape(-1, hidden.shape[-1]).float()
    return out
