"""The drop-in MoE block's mapping from transformers to chunkring, proved on the CPU (no GPU, no fake layer).

For every MoE block of a tiny random Qwen3-MoE and DeepSeek-V3 model (chunkring.testing.hf_models), the
math a :class:`ChunkringMoEBlock` hands the layer - the block's own router (:func:`route`), this rank's
experts as :func:`chunkring.load_experts` reads them from the block (:func:`expert_state_dict`), summed
over the ranks of a 1-, 2- and 4-rank split, plus the block's shared experts - is computed by chunkring's
fp32 reference (:func:`moe_reference`) and compared with the transformers block's own output in fp32 on
the hidden states the model feeds it. The weights are bfloat16 values (the model is bf16, as the adapter
requires), so loading them is exact and fp32 accumulation order is the only difference: the bound is
1e-5 relative (measured ~1e-7). For the FP8 payload the same holds with the FP8 weights dequantised and
the activations quantised per 1x128 and dequantised: the FP8 gate/up scale blocks map to the right rows.
Then what the adapter refuses."""

from __future__ import annotations

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from chunkring import ChunkringUsageError, MoEConfig, load_experts  # noqa: E402
from chunkring.integrations.transformers import (  # noqa: E402
    expert_state_dict,
    find_moe_blocks,
    plan_moe_blocks,
    replace_moe_blocks,
    route,
)
from chunkring.moe.weights import Fp8Weight, quantize_weight_fp8  # noqa: E402
from chunkring.ring.spec import PayloadFormat  # noqa: E402
from chunkring.testing.hf_models import ARCHITECTURES, tiny_model  # noqa: E402
from chunkring.testing.reference import dequantize_fp8_per128, moe_reference, quantize_fp8_per128  # noqa: E402

TOKENS = (3, 21)  # batch 3, 21 tokens: 63 rows per block, not a multiple of anything
EXACT = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def block_io(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each MoE block's input and output (by name) in one forward of ``model`` on ``ids``."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [b.module.register_forward_hook(lambda m, args, out, name=b.name: seen.__setitem__(name, (args[0], out)))
             for b in find_moe_blocks(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def localise(idx: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """topk_idx as rank [first, first + count)'s consumer computes it: its experts renumbered from 0, the
    others masked (-1)."""
    mine = (idx >= first) & (idx < first + count)
    return torch.where(mine, idx - first, torch.full_like(idx, -1))


@torch.no_grad()  # reference math: the blocks' parameters require grad, which no comparison needs
def chunkring_math(bf16_block, fp32_block, x: torch.Tensor, config: MoEConfig, world: int) -> torch.Tensor:
    """fp32 [n, H]: what the drop-in computes for ``x`` [n, H] fp32, its experts split over ``world``
    ranks (each rank's share loaded from the bf16 model's block), plus the shared experts."""
    idx, w = route(fp32_block, x)
    per_rank = config.num_experts // world
    out = torch.zeros_like(x)
    for rank in range(world):
        w13, w2 = load_experts(expert_state_dict(bf16_block), config, first_expert=rank * per_rank, count=per_rank)
        assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        out += moe_reference(x, localise(idx, rank * per_rank, per_rank), w, w13.float(), w2.float())
    if getattr(fp32_block, "shared_experts", None) is not None:
        out = out + fp32_block.shared_experts(x)
    return out


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request):
    """(architecture, bf16 model, fp32 copy of it - the same values - , input ids)."""
    bf16 = tiny_model(request.param, seed=7)
    return request.param, bf16, copy.deepcopy(bf16).float(), torch.randint(0, 128, TOKENS,
                                                                            generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_block_matches_transformers_in_fp32(models, world):
    arch, bf16, fp32, ids = models
    plan = plan_moe_blocks(bf16, world_size=world, max_tokens_per_rank=64, payload="bf16")
    assert [b.name for b, _ in plan] == (["model.layers.0.mlp", "model.layers.1.mlp"] if arch == "qwen3_moe"
                                         else ["model.layers.1.mlp", "model.layers.2.mlp"])
    fp32_blocks = {b.name: b.module for b in find_moe_blocks(fp32)}
    io = block_io(fp32, ids)
    errors = []
    for block, config in plan:
        assert (config.num_experts, config.topk, config.hidden, config.intermediate) == (8, 2, 256, 128)
        x, want = io[block.name]
        rows = x.reshape(-1, config.hidden)
        got = chunkring_math(block.module, fp32_blocks[block.name], rows, config, world)
        errors.append(rel(got, want.reshape(-1, config.hidden)))
    print(f"{arch}, {world} rank(s): relative error per block {[format(e, '.1e') for e in errors]}")
    assert max(errors) < EXACT, errors


def test_the_routing_is_the_models(models):
    """route() is the block's own gate: Qwen3-MoE's renormalised softmax top-k rounded to the model's dtype,
    DeepSeek-V3's group-limited sigmoid top-k times routed_scaling_factor; its choices are what the
    transformers block computes with (the block's output with route()'s choices passed to its experts is
    the block's output, bitwise)."""
    arch, bf16, _, ids = models
    io = block_io(bf16, ids)
    for block in find_moe_blocks(bf16):
        x, want = io[block.name]
        rows = x.reshape(-1, block.hidden)
        idx, w = route(block.module, rows)
        assert idx.dtype == torch.int32 and w.dtype == torch.float32 and idx.shape == w.shape == (rows.shape[0], 2)
        with torch.no_grad():
            routed = block.module.experts(rows, idx.long(), w.to(torch.bfloat16 if arch == "qwen3_moe" else w.dtype))
            if block.shared_experts:
                routed = routed + block.module.shared_experts(rows)
        assert torch.equal(routed, want.reshape(-1, block.hidden))
        if arch == "qwen3_moe":  # norm_topk_prob: the bf16-rounded weights sum to 1 within bf16
            torch.testing.assert_close(w.sum(-1), torch.ones(rows.shape[0]), atol=1e-2, rtol=0)
            assert torch.equal(w, w.to(torch.bfloat16).float())
        else:  # routed_scaling_factor 2.5 after renormalising, and at most topk_group = 2 of the 4 groups used
            torch.testing.assert_close(w.sum(-1), torch.full((rows.shape[0],), 2.5), atol=1e-5, rtol=0)
            assert int((idx // 2).sort(-1).values.diff(dim=-1).ne(0).sum(-1).max()) <= 1


def test_loaded_experts_are_the_blocks_weights(models):
    """w13 = gate_up_proj (gate rows, then up rows) and w2 = down_proj of this rank's experts, bitwise."""
    _, bf16, _, _ = models
    for block, config in plan_moe_blocks(bf16, world_size=4, max_tokens_per_rank=64, payload="bf16"):
        experts = block.module.experts
        for rank in range(4):
            w13, w2 = load_experts(expert_state_dict(block.module), config, first_expert=2 * rank, count=2)
            assert torch.equal(w13, experts.gate_up_proj[2 * rank:2 * rank + 2])
            assert torch.equal(w2, experts.down_proj[2 * rank:2 * rank + 2])


def test_fp8_mapping_matches_transformers_on_dequantised_inputs(models):
    """FP8 payload: the experts as the layer takes them (128x128 block-quantised), dequantised, and the
    activations quantised per 1x128 and dequantised - the transformers experts module given the same
    dequantised weights and activations (and the same routing) computes the same fp32 result."""
    arch, bf16, fp32, ids = models
    io = block_io(fp32, ids)
    fp32_blocks = {b.name: b.module for b in find_moe_blocks(fp32)}
    for block, config in plan_moe_blocks(bf16, world_size=2, max_tokens_per_rank=64, payload="fp8"):
        x, _ = io[block.name]
        rows = x.reshape(-1, config.hidden)
        idx, w = route(fp32_blocks[block.name], rows)
        x_dq = dequantize_fp8_per128(*quantize_fp8_per128(rows))
        shares = [load_experts(expert_state_dict(block.module), config, first_expert=4 * r, count=4) for r in (0, 1)]
        assert all(isinstance(t, Fp8Weight) for share in shares for t in share)
        w13 = torch.cat([s[0].dequantize() for s in shares])
        w2 = torch.cat([s[1].dequantize() for s in shares])
        experts = block.module.experts
        assert torch.equal(w13, quantize_weight_fp8(experts.gate_up_proj).dequantize())
        assert torch.equal(w2, quantize_weight_fp8(experts.down_proj).dequantize())
        got = sum(moe_reference(x_dq, localise(idx, 4 * r, 4), w, s[0].dequantize(), s[1].dequantize())
                  for r, s in enumerate(shares))
        hf_experts = copy.deepcopy(fp32_blocks[block.name].experts)
        with torch.no_grad():
            hf_experts.gate_up_proj.copy_(w13)
            hf_experts.down_proj.copy_(w2)
            want = hf_experts(x_dq, idx.long(), w)
        assert rel(got, want) < EXACT, (arch, block.name, rel(got, want))


def test_streaming_configures_the_default_ring(models):
    _, bf16, _, _ = models
    (_, batch), *_ = plan_moe_blocks(bf16, world_size=2, max_tokens_per_rank=64)
    (_, streamed), *_ = plan_moe_blocks(bf16, world_size=2, max_tokens_per_rank=64, streaming=True)
    (_, own), *_ = plan_moe_blocks(bf16, world_size=2, max_tokens_per_rank=64, stream_slots=3,
                                   stream_slot_tokens=8)
    assert batch.payload == PayloadFormat.FP8_E4M3 and not batch.streaming
    assert streamed == batch.with_default_ring() and (own.stream_slots, own.stream_slot_tokens) == (3, 8)


# ------------------------------------------------------------------ what is refused


def refused(model, field_end: str, **kwargs):
    args = {"world_size": 1, "max_tokens_per_rank": 64, **kwargs}
    with pytest.raises(ChunkringUsageError) as info:
        plan_moe_blocks(model, **args)
    assert (info.value.field or "").endswith(field_end), (info.value.field, str(info.value))
    return info.value


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_refused_configs(arch):
    # FP8 needs I a multiple of 128; the bf16 payload takes 64.
    small = tiny_model(arch, moe_intermediate_size=64)
    assert "moe_intermediate_size = 64" in str(refused(small, "mlp.intermediate", payload="fp8"))
    plan_moe_blocks(small, world_size=2, max_tokens_per_rank=8, payload="bf16")
    model = tiny_model(arch)
    refused(model, "num_experts", world_size=3)  # 8 experts over 3 ranks
    refused(model, "max_tokens_per_rank", max_tokens_per_rank=0)
    refused(model, "payload", payload="int4")
    refused(model, "streaming", streaming="yes")
    refused(copy.deepcopy(model).float(), "experts.0.gate_proj.weight")  # fp32 experts are not rounded silently
    refused(tiny_model(arch, hidden_act="gelu"), "experts.act_fn")


def test_refused_models():
    from transformers import MixtralConfig, MixtralForCausalLM

    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=128, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                               num_local_experts=4, num_experts_per_tok=2))
    assert "MixtralSparseMoeBlock" in str(refused(mixtral, "model.layers.0.mlp"))
    dense = tiny_model("qwen3_moe", mlp_only_layers=[0, 1])
    assert "no MoE block" in str(refused(dense, "model"))
    refused(torch.nn.Linear(2, 2), "model")
    refused("not a model", "model")


def test_chunkring_imports_without_transformers():
    """The adapter is optional: ``import chunkring`` (and the adapter module itself) never imports it."""
    code = ("import sys, chunkring, chunkring.integrations.transformers, chunkring.testing.hf_models; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("setting", "field"), [({"decode": "sometimes"}, "decode"),
                                                ({"eager_graphs": 1}, "eager_graphs")])
def test_a_bad_layer_setting_is_refused_before_any_block_is_replaced(setting, field):
    model = tiny_model("qwen3_moe")
    blocks = [b.module for b in find_moe_blocks(model)]
    runtime = SimpleNamespace(rank=0, world_size=1, torch_device=torch.device("cpu"))
    with pytest.raises(ChunkringUsageError) as info:
        replace_moe_blocks(model, runtime, max_tokens_per_rank=64, **setting)
    assert info.value.field == field
    assert [b.module for b in find_moe_blocks(model)] == blocks, "the model is as it was"
