"""The fp32 MoE reference equals a naive per-token loop (masked choices add nothing, all-masked tokens
are zero); FP8 per-128 quantisation round-trips within e4m3's rounding error, zero blocks stay exact
with scale 1, and bad input is refused with the field named."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringUsageError
from chunkring.testing.reference import E4M3_MAX, dequantize_fp8_per128, moe_reference, quantize_fp8_per128


def random_layer(seed, n, hidden, inter, num_experts, topk, mask_p=0.25):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen)
    idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :topk].to(torch.int32)
    idx[torch.rand(n, topk, generator=gen) < mask_p] = -1
    weights = torch.rand(n, topk, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return x, idx, weights, w13, w2


def naive_moe(x, idx, weights, w13, w2):
    """One token, one choice at a time, in float64 so the comparison measures the reference's error."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e == -1:
                continue
            h = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 12), st.sampled_from([8, 128]), st.sampled_from([4, 16]),
       st.integers(1, 6), st.sampled_from([0.0, 0.25, 1.0]), st.data())
def test_reference_matches_a_naive_per_token_loop(seed, n, hidden, inter, num_experts, mask_p, data):
    topk = data.draw(st.integers(1, num_experts))
    x, idx, weights, w13, w2 = random_layer(seed, n, hidden, inter, num_experts, topk, mask_p)
    out = moe_reference(x, idx, weights, w13, w2)
    assert out.dtype == torch.float32 and out.shape == (n, hidden)
    torch.testing.assert_close(out, naive_moe(x, idx, weights, w13, w2).float(), rtol=1e-4, atol=1e-5)


def test_masked_choices_add_nothing_whatever_their_weight():
    x, idx, weights, w13, w2 = random_layer(1, 6, 128, 16, 4, 3, mask_p=0.0)
    idx[0] = -1  # token 0: every choice masked
    idx[1, 1] = -1  # token 1: one choice masked
    weights[idx == -1] = 123.0  # masked weights must not leak in
    out = moe_reference(x, idx, weights, w13, w2)
    assert torch.equal(out[0], torch.zeros(128))
    keep = idx.clone()
    keep[1, 1] = keep[1, 0]  # same token with the masked choice replaced by a zero-weight copy
    zeroed = weights.clone()
    zeroed[1, 1] = 0.0
    torch.testing.assert_close(out[1], moe_reference(x, keep, zeroed, w13, w2)[1])
    assert moe_reference(x[:0], idx[:0], weights[:0], w13, w2).shape == (0, 128)


def test_reference_is_deterministic():
    args = random_layer(2, 32, 128, 16, 8, 4)
    assert torch.equal(moe_reference(*args), moe_reference(*args))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(1, 4), st.sampled_from([1e-30, 1e-3, 1.0, 1e30]),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_fp8_round_trip_error_bound(seed, n, blocks, magnitude, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, 128 * blocks, generator=gen) * magnitude).to(dtype)
    # Blocks of very different magnitude in one row: each block must get its own scale.
    x[:, :128] *= 1e-4
    x_fp8, x_sf = quantize_fp8_per128(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert x_sf.dtype == torch.float32 and x_sf.shape == (n, blocks)
    assert bool(torch.isfinite(x_fp8.float()).all())
    back = dequantize_fp8_per128(x_fp8, x_sf)
    ref = x.float().reshape(n, blocks, 128)
    err = (back.reshape(n, blocks, 128) - ref).abs()
    absmax = ref.abs().amax(dim=-1, keepdim=True)
    assert bool((err <= 2.0**-3 * absmax).all())
    # The tight form: half an e4m3 ulp, 2^-4 relative for normals, 2^-10 * scale in the subnormal range.
    tight = torch.maximum(ref.abs() * 2.0**-4, x_sf.unsqueeze(-1) * 2.0**-10) * (1 + 2.0**-12)
    assert bool((err <= tight).all())
    # Each block's absmax maps onto 448 exactly.
    top = x_fp8.float().reshape(n, blocks, 128).abs().amax(dim=-1)
    assert bool((top[absmax.squeeze(-1) > 0] == E4M3_MAX).all())


def test_zero_blocks_get_scale_one_and_stay_zero():
    x = torch.zeros(3, 384)
    x[1, 200] = -5.0
    x_fp8, x_sf = quantize_fp8_per128(x)
    expected = torch.ones(3, 3)
    expected[1, 1] = torch.tensor(5.0) / E4M3_MAX  # in fp32, as the quantiser computes it
    assert torch.equal(x_sf, expected)
    assert torch.equal(dequantize_fp8_per128(x_fp8, x_sf), x)


@pytest.mark.parametrize("call,field", [
    (lambda: quantize_fp8_per128(torch.zeros(2, 100)), "x"),
    (lambda: quantize_fp8_per128(torch.zeros(2, 128, dtype=torch.float16)), "x"),
    (lambda: quantize_fp8_per128(torch.zeros(128)), "x"),
    (lambda: quantize_fp8_per128(torch.full((1, 128), float("inf"))), "x"),
    (lambda: dequantize_fp8_per128(torch.zeros(2, 128), torch.ones(2, 1)), "x_fp8"),
    (lambda: dequantize_fp8_per128(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 2)), "x_sf"),
    (lambda: dequantize_fp8_per128(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 1).double()),
     "x_sf"),
])
def test_fp8_bad_input_is_refused(call, field):
    with pytest.raises(ChunkringUsageError) as info:
        call()
    assert info.value.field == field, str(info.value)


def layer_with(**changes):
    x, idx, weights, w13, w2 = random_layer(3, 4, 128, 8, 4, 2)
    args = dict(x=x, topk_idx=idx, topk_weights=weights, w13=w13, w2=w2)
    args.update({k: v(args[k]) for k, v in changes.items()})
    return moe_reference(**args)


@pytest.mark.parametrize("changes,field", [
    ({"x": lambda x: x.bfloat16()}, "x"),
    ({"x": lambda x: x[0]}, "x"),
    ({"topk_idx": lambda i: i.long()}, "topk_idx"),
    ({"topk_idx": lambda i: i[:3]}, "topk_idx"),
    ({"topk_idx": lambda i: i + 4}, "topk_idx"),  # 4 == num_experts
    ({"topk_idx": lambda i: i.clamp(min=0) - 2}, "topk_idx"),
    ({"topk_weights": lambda w: w[:, :1]}, "topk_weights"),
    ({"topk_weights": lambda w: w.double()}, "topk_weights"),
    ({"w13": lambda w: w[:, :15]}, "w13"),  # odd 2I
    ({"w13": lambda w: w[:, :, :64]}, "w13"),  # H mismatch
    ({"w13": lambda w: w.bfloat16()}, "w13"),
    ({"w2": lambda w: w[:, :, :4]}, "w2"),
    ({"w2": lambda w: w[:3]}, "w2"),
    ({"w2": lambda w: w.to("meta")}, "w2"),
])
def test_moe_bad_input_is_refused(changes, field):
    with pytest.raises(ChunkringUsageError) as info:
        layer_with(**changes)
    assert info.value.field == field, str(info.value)


def test_the_plan_reference_is_the_layer_reference_row_by_row():
    """plan_reference (the expert work on a plan, what the GPU tests and bench_persistent hold the GEMM engines to)
    gives each planned row what moe_reference's FP8 recipe gives its token when that token has one choice of weight
    1: the same roundings, one expert at a time, rows in plan order, padding rows left out."""
    from types import SimpleNamespace

    from chunkring.testing.reference import plan_reference

    gen = torch.Generator().manual_seed(7)
    E, H, inter, n = 3, 256, 128, 7
    x = torch.randn(n, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=gen) / 16, torch.randn(E, H, inter, generator=gen) / 16
    experts = [2, 0, 2, 1, 0, 2, 2]
    # Groups in expert order, each after 2 padding rows; token t's row in its expert's group.
    order = sorted(range(n), key=lambda t: experts[t])
    counts = [experts.count(e) for e in range(E)]
    group_end, token, at = [], [], 0
    for e in range(E):
        token += [-1, -1] + [t for t in order if experts[t] == e]
        at += 2 + counts[e]
        group_end.append(at)
    plan = SimpleNamespace(counts=torch.tensor(counts, dtype=torch.int32),
                           group_end=torch.tensor(group_end, dtype=torch.int32),
                           token=torch.tensor(token, dtype=torch.int32))
    rows, outs, acts = plan_reference(plan, x, lambda e: w13[e], lambda e: w2[e])
    assert rows.tolist() == [i for i, t in enumerate(token) if t >= 0]
    assert acts.shape == (n, inter)
    want = moe_reference(x, torch.tensor(experts, dtype=torch.int32)[:, None], torch.ones(n, 1), w13, w2,
                         fp8_recipe=True)
    torch.testing.assert_close(outs, want[plan.token[rows].long()], rtol=1e-5, atol=1e-5)
