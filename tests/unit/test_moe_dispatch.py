"""The consumer's fixed-shape expert work (chunkring.moe.dispatch), on CPU: plan_experts agrees row for row
with the host planner (the batch plan: one expert group per local expert over every pulled row), whatever
stale bytes sit in rows no chunk brought; and the whole call (plan -> gather -> L1/SwiGLU/L2 -> weight),
combined per source and reduced over k, matches the fp32 reference for bf16 and FP8 payloads. The same
code runs on the GPU inside the layer."""

import torch
from hypothesis import given, settings

from chunkring.moe.dispatch import padded_rows_bound, plan_experts
from chunkring.testing.plan import plan_batch
from chunkring.testing.reference import (
    dequantize_fp8_per128,
    expert_forward,
    gather_rows,
    moe_reference,
    quantize_fp8_per128,
)
from tests.unit.test_moe_plan import make_routes, scenarios


def stage_call(idx_list, w_list, rows_per_source, gen):
    """What moe_pull leaves after a call: each source's rows at their token index, topk_idx -1 in the rows
    no chunk brought (the layer's refill before the pull) and stale random weights there."""
    W, N, K = len(idx_list), rows_per_source, idx_list[0].shape[1]
    stage_idx = torch.full((W, N, K), -1, dtype=torch.int32)
    stage_w = torch.rand(W, N, K, generator=gen)
    for s, (idx, w) in enumerate(zip(idx_list, w_list)):
        stage_idx[s, :idx.shape[0]], stage_w[s, :idx.shape[0]] = idx, w
    return stage_idx, stage_w


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_plan_experts_matches_the_host_planner(sc):
    idx_list, w_list = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    gen = torch.Generator().manual_seed(sc["seed"] + 1)
    W, K, E = sc["world"], sc["topk"], sc["experts_per_rank"]
    N = max(sc["ns"]) + sc["tokens_per_slot"]  # rows past every batch: what no chunk brought
    capacity = padded_rows_bound(N, K, W, E, sc["block_m"])
    stage_idx, stage_w = stage_call(idx_list, w_list, N, gen)
    for dest in range(W):
        want = plan_batch(idx_list, w_list, dest_rank=dest, world_size=W, num_experts=sc["num_experts"],
                          block_m=sc["block_m"])
        got = plan_experts(stage_idx, stage_w, first_expert=dest * E, experts_per_rank=E, block_m=sc["block_m"],
                           capacity=capacity)
        assert torch.equal(got.expert_offsets, want.expert_offsets)
        assert torch.equal(got.counts, want.counts)
        rows = want.num_padded_rows
        for name, host in (("src_rank", "src_rank"), ("topk_pos", "topk_pos"), ("token_index", "token_index")):
            assert torch.equal(getattr(got, name)[:rows], getattr(want, host).to(torch.int64)), name
            assert bool((getattr(got, name)[rows:] == -1).all()), name
        assert torch.equal(got.weight[:rows], want.weight)
        assert bool((got.weight[rows:] == 0).all())


def run_loopback(payload, ns, num_experts, world, topk, hidden=256, inter=64, block_m=16, seed=0):
    """Every rank's consumer in one process; returns per-source outputs and references."""
    gen = torch.Generator().manual_seed(seed)
    E = num_experts // world
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
    idx_list, w_list = make_routes(ns, num_experts, topk, "distinct", seed)
    xs = [torch.randn(n, hidden, generator=gen) for n in ns]
    if payload == "fp8":
        quant = [quantize_fp8_per128(x) for x in xs]
        x_in = [dequantize_fp8_per128(q, s) for q, s in quant]
    else:
        quant = [(x.to(torch.bfloat16), None) for x in xs]
        x_in = [q.float() for q, _ in quant]
    combine = [torch.zeros(n * topk, hidden) for n in ns]
    N = max(ns) + 3  # rows no chunk brought: stale, never read
    capacity = padded_rows_bound(N, topk, world, E, block_m)
    stage_idx, stage_w = stage_call(idx_list, w_list, N, gen)
    dtype = torch.float8_e4m3fn if payload == "fp8" else torch.bfloat16
    stage_x = torch.full((world, N, hidden), float("nan")).to(dtype)
    stage_sf = torch.full((world, N, hidden // 128), float("nan")) if payload == "fp8" else None
    for s, n in enumerate(ns):
        stage_x[s, :n] = quant[s][0]
        if stage_sf is not None:
            stage_sf[s, :n] = quant[s][1]
    for dest in range(world):
        plan = plan_experts(stage_idx, stage_w, first_expert=dest * E, experts_per_rank=E, block_m=block_m,
                            capacity=capacity)
        rows = gather_rows(plan, stage_x, stage_sf)
        out = expert_forward(plan, rows, w13[dest * E:(dest + 1) * E], w2[dest * E:(dest + 1) * E])
        for p in torch.nonzero(plan.real).flatten().tolist():  # what moe_combine_push does
            s, t, k = int(plan.src_rank[p]), int(plan.token_index[p]), int(plan.topk_pos[p])
            combine[s][t * topk + k] = out[p]
    outs = [c.reshape(n, topk, hidden).sum(1) for c, n in zip(combine, ns)]
    refs = [moe_reference(x, i, w, w13.float(), w2.float()) for x, i, w in zip(x_in, idx_list, w_list)]
    return outs, refs


def test_loopback_matches_the_reference():
    for payload in ("bf16", "fp8"):
        outs, refs = run_loopback(payload, ns=[0, 5, 37, 16], num_experts=8, world=4, topk=3)
        for s, (out, ref) in enumerate(zip(outs, refs)):
            assert bool(torch.isfinite(out).all())
            if ref.numel():
                rel = float((out - ref).norm() / ref.norm())
                assert rel < 1e-2, (payload, s, rel)
