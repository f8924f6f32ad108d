"""Tiny random Hugging Face MoE models for the drop-in block's tests (no download: configs built here).

Both have H = 256, I = 128 (``moe_intermediate_size``), 8 routed experts, top-2, a 128-token vocabulary:
shapes every payload takes (multiples of 128) and whose experts split over 1, 2, 4 and 8 ranks.
Qwen3-MoE: 2 layers, both MoE. DeepSeek-V3: 3 layers, the first dense (``first_k_dense_replace`` = 1),
then 2 MoE layers with group-limited routing (4 groups, 2 chosen), one shared expert and a routed scaling
factor of 2.5. Every router, and DeepSeek-V3's score-correction bias, is drawn from the seed (transformers
may leave a router at zero), scaled so that top-k choices are clear-cut rather than near-ties.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ARCHITECTURES", "tiny_config", "tiny_model"]

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
               **overrides: Any) -> nn.Module:
    """A ``*ForCausalLM`` of :func:`tiny_config` in eval mode, on the CPU, in ``dtype``, its weights drawn
    from ``seed`` (routers and DeepSeek-V3's correction bias redrawn here, see the module docstring)."""
    config = tiny_config(architecture, **overrides)
    if architecture == "qwen3_moe":
        from transformers import Qwen3MoeForCausalLM as model_class
    else:
        from transformers import DeepseekV3ForCausalLM as model_class
    torch.manual_seed(seed)
    model = model_class(config)
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
