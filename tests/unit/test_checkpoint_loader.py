"""The checkpoint loader (chunkring.moe.load_experts) gives each rank exactly its experts in the layer's
layout - w13 gate rows then up rows, w2 as stored - for both checkpoint formats and both payloads:
bf16 checkpoints match chunkring.expert_weights' path bit for bit, DeepSeek-V3 FP8 checkpoints keep their
bytes and weight_scale_inv blocks (FP8 payload) or dequantise as DeepSeek's weight_dequant does (bf16
payload); the ranks' shares concatenate to the whole; only the rank's own keys are read; and every bad
key is refused by name, before anything is allocated on the requested device."""

import re
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat
from chunkring.moe import HF_EXPERT_KEYS, ExpertKeys, Fp8Weight, init_weights, load_experts, quantize_weight_fp8

PREFIX = "model.layers.3.mlp."
FP8 = MoEConfig(num_experts=8, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=16)
# Partial 128-blocks in each weight's one dimension: the bf16 payload's intermediate may be any multiple of 8.
BF16 = MoEConfig(num_experts=8, hidden=256, intermediate=136, topk=2, max_tokens_per_rank=16,
                 payload=PayloadFormat.BF16)
# Where each check must fail first: a CUDA device on a CPU-only build (or a real one on the GPU host), so
# an error raised after an allocation would be torch's, not ours.
UNTOUCHED = torch.device("cuda:0")


def key(e, proj):
    return f"{PREFIX}experts.{e}.{proj}_proj.weight"


def unrelated(config):
    """Keys a whole-model state dict holds next to the experts: the loader must leave them alone."""
    H = config.hidden
    return {f"{PREFIX}gate.weight": torch.zeros(config.num_experts, H), f"{PREFIX}gate.e_score_correction_bias":
            torch.zeros(config.num_experts), f"{PREFIX}shared_experts.gate_proj.weight": torch.zeros(8, H),
            "model.layers.4.mlp.experts.0.gate_proj.weight": torch.zeros(3, 3), "lm_head.weight": torch.zeros(4, H)}


def bf16_checkpoint(config, seed=0):
    """A bf16 state dict of every expert, and the whole w13 [E, 2I, H] / w2 [E, H, I] it holds."""
    _, w13, w2 = init_weights(config, torch.Generator().manual_seed(seed))
    inter = config.intermediate
    sd = unrelated(config)
    for e in range(config.num_experts):
        sd[key(e, "gate")], sd[key(e, "up")], sd[key(e, "down")] = w13[e, :inter], w13[e, inter:], w2[e]
    return sd, w13, w2


def fp8_projection(shape, gen):
    """float8_e4m3fn [N, K] and a float32 [ceil(N/128), ceil(K/128)] weight_scale_inv, drawn independently of
    chunkring's quantiser (no NaN bytes)."""
    data = (torch.randn(shape, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(tuple(-(-n // 128) for n in shape), generator=gen) * 1e-2 + 1e-4
    return data, scale


def fp8_checkpoint(config, seed=0):
    """A DeepSeek-V3-style FP8 state dict of every expert: {key: weight, key + '_scale_inv': scale}."""
    gen = torch.Generator().manual_seed(seed)
    H, inter = config.hidden, config.intermediate
    sd = unrelated(config)
    for e in range(config.num_experts):
        for proj, shape in (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter))):
            sd[key(e, proj)], sd[key(e, proj) + "_scale_inv"] = fp8_projection(shape, gen)
    return sd


def deepseek_dequant(x, s, block=128):
    """DeepSeek-V3 inference/kernel.py weight_dequant, block by block: y = x * s[block]."""
    y = torch.empty(x.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            y[i * block:(i + 1) * block, j * block:(j + 1) * block] = (
                x[i * block:(i + 1) * block, j * block:(j + 1) * block].float() * s[i, j])
    return y


def as_bits(w):
    """A comparable form of one loaded weight: bytes for FP8 data, the tensors otherwise."""
    if isinstance(w, Fp8Weight):
        return w.data.view(torch.uint8), w.scale
    return (w,)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(as_bits(a), as_bits(b), strict=True))


def cat(parts):
    """Per-rank results concatenated over the expert dimension."""
    if isinstance(parts[0], Fp8Weight):
        return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]))
    return torch.cat(parts)


def shares(sd, config, world, **kwargs):
    E = config.num_experts // world
    return [load_experts(sd, config, first_expert=r * E, count=E, prefix=PREFIX, rank=r, **kwargs)
            for r in range(world)]


# ------------------------------------------------------------------ round trips and rank slicing

@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_checkpoint_bf16_payload(world):
    config = MoEConfig(**{**BF16.__dict__, "hidden": 128, "intermediate": 48})
    sd, w13, w2 = bf16_checkpoint(config)
    out = shares(sd, config, world)
    E = config.num_experts // world
    for r, (a13, a2) in enumerate(out):
        assert a13.dtype == a2.dtype == torch.bfloat16 and a13.is_contiguous() and a2.is_contiguous()
        assert torch.equal(a13, w13[r * E:(r + 1) * E]) and torch.equal(a2, w2[r * E:(r + 1) * E])
    assert torch.equal(cat([o[0] for o in out]), w13) and torch.equal(cat([o[1] for o in out]), w2)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bf16_checkpoint_fp8_payload_is_expert_weights_path(world):
    sd, w13, w2 = bf16_checkpoint(FP8)
    out = shares(sd, FP8, world)
    E = FP8.num_experts // world
    for r, (a13, a2) in enumerate(out):
        assert isinstance(a13, Fp8Weight) and isinstance(a2, Fp8Weight)
        assert same(a13, quantize_weight_fp8(w13[r * E:(r + 1) * E]))  # what chunkring.expert_weights gives
        assert same(a2, quantize_weight_fp8(w2[r * E:(r + 1) * E]))
    assert same(cat([o[0] for o in out]), quantize_weight_fp8(w13))
    assert same(cat([o[1] for o in out]), quantize_weight_fp8(w2))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp8_checkpoint_fp8_payload_keeps_bytes_and_scales(world):
    sd = fp8_checkpoint(FP8)
    out = shares(sd, FP8, world)
    E, ib = FP8.num_experts // world, FP8.intermediate // 128
    for r, (a13, a2) in enumerate(out):
        assert a13.data.shape == (E, 2 * FP8.intermediate, FP8.hidden) and a13.scale.shape == (E, 2 * ib, 2)
        assert a2.data.shape == (E, FP8.hidden, FP8.intermediate) and a2.scale.shape == (E, 2, ib)
        for i in range(E):
            e = r * E + i
            gate, up, down = (sd[key(e, p)] for p in ("gate", "up", "down"))
            assert torch.equal(a13.data[i].view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))
            assert torch.equal(a2.data[i].view(torch.uint8), down.view(torch.uint8))
            assert torch.equal(a13.scale[i], torch.cat([sd[key(e, "gate") + "_scale_inv"],
                                                        sd[key(e, "up") + "_scale_inv"]]))
            assert torch.equal(a2.scale[i], sd[key(e, "down") + "_scale_inv"])
            # Fp8Weight's scale convention is DeepSeek's: its dequantisation is weight_dequant's.
            dequantized = [deepseek_dequant(sd[key(e, p)], sd[key(e, p) + "_scale_inv"]) for p in ("gate", "up")]
            assert torch.equal(a13.dequantize()[i], torch.cat(dequantized))
    whole = shares(sd, FP8, 1)[0]
    assert same(cat([o[0] for o in out]), whole[0]) and same(cat([o[1] for o in out]), whole[1])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp8_checkpoint_bf16_payload_dequantises(world):
    sd = fp8_checkpoint(BF16)
    out = shares(sd, BF16, world)
    E, inter = BF16.num_experts // world, BF16.intermediate
    for r, (a13, a2) in enumerate(out):
        assert a13.dtype == a2.dtype == torch.bfloat16
        for i in range(E):
            e = r * E + i
            ref = {p: deepseek_dequant(sd[key(e, p)], sd[key(e, p) + "_scale_inv"]).to(torch.bfloat16)
                   for p in ("gate", "up", "down")}
            assert torch.equal(a13[i, :inter], ref["gate"]) and torch.equal(a13[i, inter:], ref["up"])
            assert torch.equal(a2[i], ref["down"])


def test_fp8_checkpoint_quantised_by_chunkring_round_trips():
    """An FP8 checkpoint written by chunkring's own quantiser (same recipe as DeepSeek's) loads back to it."""
    _, w13, w2 = init_weights(FP8, torch.Generator().manual_seed(1))
    q13, q2 = quantize_weight_fp8(w13), quantize_weight_fp8(w2)
    inter, ib = FP8.intermediate, FP8.intermediate // 128
    sd = {}
    for e in range(FP8.num_experts):
        sd[key(e, "gate")], sd[key(e, "gate") + "_scale_inv"] = q13.data[e, :inter], q13.scale[e, :ib]
        sd[key(e, "up")], sd[key(e, "up") + "_scale_inv"] = q13.data[e, inter:], q13.scale[e, ib:]
        sd[key(e, "down")], sd[key(e, "down") + "_scale_inv"] = q2.data[e], q2.scale[e]
    a13, a2 = load_experts(sd, FP8, first_expert=0, count=FP8.num_experts, prefix=PREFIX)
    assert same(a13, q13) and same(a2, q2)


def test_reads_only_its_own_experts_and_works_on_a_shard():
    sd, w13, w2 = bf16_checkpoint(BF16)

    class Recording(Mapping):
        def __init__(self, inner):
            self.inner, self.got, self.asked = inner, [], set()

        def __getitem__(self, k):
            self.got.append(k)
            return self.inner[k]

        def __contains__(self, k):
            self.asked.add(k)
            return k in self.inner

        def __iter__(self):
            raise AssertionError("the loader must not walk the whole state dict")

        def __len__(self):
            raise AssertionError("the loader must not walk the whole state dict")

    rec = Recording(sd)
    a13, _ = load_experts(rec, BF16, first_expert=4, count=2, prefix=PREFIX, rank=2)
    mine = {key(e, p) for e in (4, 5) for p in ("gate", "up", "down")}
    assert sorted(rec.got) == sorted(mine)  # each read once
    assert rec.asked - mine == {key(8, "gate")} | {k + "_scale_inv" for k in mine}
    # A rank's shard of the checkpoint (its own experts only) is enough.
    shard = {k: sd[k] for k in mine}
    assert torch.equal(load_experts(shard, BF16, first_expert=4, count=2, prefix=PREFIX)[0], a13)


def test_other_names_through_expert_keys():
    """Mixtral's names: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)."""
    sd, w13, w2 = bf16_checkpoint(BF16)
    mixtral = ExpertKeys(gate="{prefix}block_sparse_moe.experts.{e}.w1.weight",
                         up="{prefix}block_sparse_moe.experts.{e}.w3.weight",
                         down="{prefix}block_sparse_moe.experts.{e}.w2.weight")
    renamed = {k.replace(PREFIX, "model.layers.3.").replace("experts.", "block_sparse_moe.experts.")
               .replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2"): v
               for k, v in sd.items() if ".experts." in k and k.startswith(PREFIX)}
    a13, a2 = load_experts(renamed, BF16, first_expert=2, count=2, prefix="model.layers.3.", keys=mixtral)
    assert torch.equal(a13, w13[2:4]) and torch.equal(a2, w2[2:4])
    assert HF_EXPERT_KEYS.key("down", "p.", 7) == "p.experts.7.down_proj.weight"
    assert HF_EXPERT_KEYS.scale_key("p.experts.7.down_proj.weight") == "p.experts.7.down_proj.weight_scale_inv"


def test_a_rank_takes_its_range_and_errors_name_the_rank():
    sd, w13, w2 = bf16_checkpoint(BF16)
    a13, a2 = load_experts(sd, BF16, first_expert=6, count=2, prefix=PREFIX, rank=3)
    assert torch.equal(a13, w13[6:]) and torch.equal(a2, w2[6:])
    del sd[key(7, "up")]
    with pytest.raises(ChunkringUsageError, match=r"expert 7's up weight, wanted by experts \[6, 8\) of rank 3"):
        load_experts(sd, BF16, first_expert=6, count=2, prefix=PREFIX, rank=3)


# ------------------------------------------------------------------ errors, each naming the key

def edit(sd, **changes):
    out = dict(sd)
    for k, v in changes.items():
        if v is None:
            out.pop(k)
        else:
            out[k] = v
    return out


def bad_bf16():
    sd, _, _ = bf16_checkpoint(BF16)
    H, inter = BF16.hidden, BF16.intermediate
    g5, u5, d5 = key(5, "gate"), key(5, "up"), key(5, "down")
    return [
        ("missing", edit(sd, **{g5: None}), g5, r"missing from the state dict \(expert 5's gate weight, "
                                                r"wanted by experts \[4, 6\) of rank 2\)"),
        ("transposed", edit(sd, **{d5: sd[d5].t()}), d5, rf"expected shape \({H}, {inter}\), got \({inter}, {H}\)"),
        ("short", edit(sd, **{u5: sd[u5][:-1]}), u5, rf"expected shape \({inter}, {H}\), got \({inter - 1}, {H}\)"),
        ("stacked", edit(sd, **{g5: sd[g5][None]}), g5, "expected shape"),
        ("float32", edit(sd, **{g5: sd[g5].float()}), g5, "expected dtype bfloat16, or float8_e4m3fn with its "
                                                         "scale, got torch.float32"),
        ("float16", edit(sd, **{u5: sd[u5].half()}), u5, "got torch.float16"),
        ("not a tensor", edit(sd, **{d5: sd[d5].tolist()}), d5, "expected a torch.Tensor, got list"),
        ("bf16 with a scale", edit(sd, **{g5 + "_scale_inv": torch.ones(2, 2)}), g5 + "_scale_inv",
         "bfloat16, not float8_e4m3fn"),
        ("mixed in an expert", edit(sd, **{u5: sd[u5].to(torch.float8_e4m3fn), u5 + "_scale_inv": torch.ones(2, 2)}),
         u5, f"is torch.float8_e4m3fn but {re.escape(key(4, 'gate'))} is torch.bfloat16"),
        ("more experts", edit(sd, **{key(8, "gate"): sd[g5]}), key(8, "gate"), "has an expert 8"),
    ]


def bad_fp8():
    sd = fp8_checkpoint(FP8)
    g5, u5, d5 = key(5, "gate"), key(5, "up"), key(5, "down")
    return [
        ("no scale", edit(sd, **{g5 + "_scale_inv": None}), g5, re.escape(f"its scale {g5}_scale_inv is missing")),
        ("scale of K blocks", edit(sd, **{d5 + "_scale_inv": sd[d5 + "_scale_inv"].t()}), d5 + "_scale_inv",
         r"expected shape \(2, 1\) \(one scale per 128x128 block of \(256, 128\)\), got \(1, 2\)"),
        ("per-row scale", edit(sd, **{u5 + "_scale_inv": torch.ones(128, 2)}), u5 + "_scale_inv", "got \\(128, 2\\)"),
        ("bf16 scale", edit(sd, **{u5 + "_scale_inv": sd[u5 + "_scale_inv"].bfloat16()}), u5 + "_scale_inv",
         "expected dtype torch.float32, got torch.bfloat16"),
        ("scale not a tensor", edit(sd, **{u5 + "_scale_inv": 1.0}), u5 + "_scale_inv", "got float"),
        ("e5m2", edit(sd, **{d5: sd[d5].to(torch.float8_e5m2)}), d5, "got torch.float8_e5m2"),
        ("mixed across experts", edit(sd, **{key(5, p): torch.zeros(sd[key(5, p)].shape, dtype=torch.bfloat16)
                                             for p in ("gate", "up", "down")} | {key(5, p) + "_scale_inv": None
                                                                                for p in ("gate", "up", "down")}),
         g5, f"is torch.bfloat16 but {re.escape(key(4, 'gate'))} is torch.float8_e4m3fn"),
    ]


@pytest.mark.parametrize("config, case", [(BF16, c) for c in bad_bf16()] + [(FP8, c) for c in bad_fp8()],
                         ids=lambda v: v[0] if isinstance(v, tuple) else v.payload.name)
def test_bad_key_is_named_before_any_allocation(config, case):
    _, sd, field, message = case
    with pytest.raises(ChunkringUsageError) as info:
        load_experts(sd, config, first_expert=4, count=2, prefix=PREFIX, rank=2, device=UNTOUCHED)
    assert info.value.field == field, str(info.value)
    assert re.search(message, str(info.value)), str(info.value)


def test_keys_of_other_ranks_are_not_checked():
    sd, _, _ = bf16_checkpoint(BF16)
    sd = edit(sd, **{key(0, "gate"): None, key(7, "down"): torch.zeros(3)})
    load_experts(sd, BF16, first_expert=2, count=4, prefix=PREFIX)


@pytest.mark.parametrize("kwargs, field", [
    (dict(config=BF16.__dict__), "config"),
    (dict(state_dict=[("a", torch.zeros(1))]), "state_dict"),
    (dict(keys={"gate": "x"}), "keys"),
    (dict(prefix=3), "prefix"),
    (dict(first_expert=-1), "first_expert"),
    (dict(first_expert=True), "first_expert"),
    (dict(count=0), "count"),
    (dict(count=2.0), "count"),
    (dict(first_expert=7, count=2), "count"),
    (dict(rank=-1), "rank"),
    (dict(rank=False), "rank"),
    (dict(device="gpu7"), "device"),
    (dict(device=1.5), "device"),
])
def test_bad_arguments(kwargs, field):
    sd, _, _ = bf16_checkpoint(BF16)
    args = dict(state_dict=sd, config=BF16, first_expert=0, count=2, prefix=PREFIX, device=UNTOUCHED) | kwargs
    with pytest.raises(ChunkringUsageError) as info:
        load_experts(**args)
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize("kwargs, field, needle", [
    (dict(gate="{prefix}experts.0.gate_proj.weight"), "gate", "needs {e}"),
    (dict(up="{prefix}experts.{expert}.up_proj.weight"), "up", "may use only {prefix}, {e}"),
    (dict(down="{prefix}experts.{e}.down_proj.weight{"), "down", "may use only"),
    (dict(down=None), "down", "expected a str"),
    (dict(up="{prefix}experts.{e}.gate_proj.weight"), "up", "name the same key"),
    (dict(scale="{weight}"), "scale", "names the weight itself"),
    (dict(scale="{prefix}.scale"), "scale", "may use only {weight}"),
])
def test_bad_expert_keys(kwargs, field, needle):
    with pytest.raises(ChunkringUsageError) as info:
        ExpertKeys(**kwargs)
    assert info.value.field == field and needle in str(info.value), str(info.value)


# ------------------------------------------------------------------ the property

@settings(max_examples=25, deadline=None)
@given(world=st.sampled_from([1, 2, 4]), per_rank=st.integers(1, 3), fp8_checkpoint_=st.booleans(),
       fp8_payload=st.booleans(), hidden=st.sampled_from([128, 256]), inter_blocks=st.integers(1, 2),
       bf16_inter=st.sampled_from([8, 136]), seed=st.integers(0, 2**16))
def test_ranks_shares_concatenate_to_the_whole(world, per_rank, fp8_checkpoint_, fp8_payload, hidden, inter_blocks,
                                                bf16_inter, seed):
    """Whatever the format, payload, shape and world size, rank r gets experts [r E/W, (r+1) E/W) and the
    shares, concatenated, are what one rank holding every expert gets."""
    inter = 128 * inter_blocks if fp8_payload else bf16_inter
    config = MoEConfig(num_experts=world * per_rank, hidden=hidden, intermediate=inter, topk=1,
                       max_tokens_per_rank=8, payload=PayloadFormat.FP8_E4M3 if fp8_payload else PayloadFormat.BF16)
    sd = fp8_checkpoint(config, seed) if fp8_checkpoint_ else bf16_checkpoint(config, seed)[0]
    whole = load_experts(sd, config, first_expert=0, count=config.num_experts, prefix=PREFIX)
    parts = shares(sd, config, world)
    for i in range(2):
        assert same(cat([p[i] for p in parts]), whole[i])
        for r, p in enumerate(parts):
            mine = slice(r * per_rank, (r + 1) * per_rank)
            expected = (Fp8Weight(whole[i].data[mine], whole[i].scale[mine]) if fp8_payload else whole[i][mine])
            assert same(p[i], expected)


# ------------------------------------------------------------------ the documented example runs

GPU_EXAMPLE = "# GPU example"


def test_integration_doc_example_runs():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "INTEGRATION.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if not b.startswith(GPU_EXAMPLE)]
    assert blocks, "docs/INTEGRATION.md has no python example"
    for block in blocks:  # the GPU examples: tests/gpu/test_integration_guide.py
        exec(compile(block, "docs/INTEGRATION.md", "exec"), {})
