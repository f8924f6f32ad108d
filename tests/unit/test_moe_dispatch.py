"""The consumer's fixed-shape step (chunkring.moe_dispatch), on CPU: plan_step agrees row for row with the
host planner for every chunk step, whatever stale bytes sit past each chunk's rows; and the whole
step (plan -> gather -> L1/SwiGLU/L2 -> weight), combined per source and reduced over k, matches the
fp32 reference for bf16 and FP8 payloads. The same code runs on the GPU inside the layer."""

import torch
from hypothesis import given, settings

from chunkring.moe_dispatch import STEP_NUM_TOKENS, STEP_TOKEN_BASE, expert_forward, gather_rows, plan_step
from chunkring.moe_plan import padded_rows_bound, plan_streamed
from chunkring.moe_reference import dequantize_fp8_per128, moe_reference, quantize_fp8_per128
from tests.unit.test_moe_plan import make_routes, scenarios


def stage_step(idx_list, w_list, step, tokens_per_slot, num_experts, gen):
    """What moe_pull_step leaves for chunk step ``step``: each source's chunk in rows [0, n), stale
    random routing (valid expert ids included) in the rows past n and for ended sources."""
    W, T, K = len(idx_list), tokens_per_slot, idx_list[0].shape[1]
    stage_idx = torch.randint(-1, num_experts, (W, T, K), generator=gen, dtype=torch.int32)
    stage_w = torch.rand(W, T, K, generator=gen)
    meta = torch.zeros(W, 4, dtype=torch.int64)
    for s, (idx, w) in enumerate(zip(idx_list, w_list)):
        base = step * T
        chunks = max(1, -(-idx.shape[0] // T))
        if step >= chunks:
            continue  # this source's stream ended: inactive, n = 0
        n = min(T, idx.shape[0] - base)
        stage_idx[s, :n], stage_w[s, :n] = idx[base:base + n], w[base:base + n]
        meta[s, 0], meta[s, STEP_TOKEN_BASE], meta[s, STEP_NUM_TOKENS] = 1, base, n
    return stage_idx, stage_w, meta


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_plan_step_matches_the_host_planner(sc):
    idx_list, w_list = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    gen = torch.Generator().manual_seed(sc["seed"] + 1)
    W, T, K, E = sc["world"], sc["tokens_per_slot"], sc["topk"], sc["experts_per_rank"]
    capacity = padded_rows_bound(T, K, W, E, sc["block_m"])
    for dest in range(W):
        host = plan_streamed(idx_list, w_list, tokens_per_slot=T, dest_rank=dest, world_size=W,
                             num_experts=sc["num_experts"], block_m=sc["block_m"])
        for step, want in enumerate(host):
            stage_idx, stage_w, meta = stage_step(idx_list, w_list, step, T, sc["num_experts"], gen)
            got = plan_step(stage_idx, stage_w, meta, first_expert=dest * E, experts_per_rank=E,
                            block_m=sc["block_m"], capacity=capacity)
            assert torch.equal(got.expert_offsets, want.expert_offsets)
            assert torch.equal(got.counts, want.counts)
            rows = want.num_padded_rows
            for name in ("src_rank", "src_row", "topk_pos", "token_index"):
                assert torch.equal(getattr(got, name)[:rows], getattr(want, name).to(torch.int64)), name
                assert bool((getattr(got, name)[rows:] == -1).all()), name
            assert torch.equal(got.weight[:rows], want.weight)
            assert bool((got.weight[rows:] == 0).all())


def run_loopback(payload, ns, num_experts, world, topk, tokens_per_slot, hidden=256, inter=64, block_m=16, seed=0):
    """Every rank's consumer steps in one process; returns per-source outputs and references."""
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
    steps = max(max(1, -(-n // tokens_per_slot)) for n in ns)
    T = tokens_per_slot
    capacity = padded_rows_bound(T, topk, world, E, block_m)
    for step in range(steps):
        stage_idx, stage_w, meta = stage_step(idx_list, w_list, step, T, num_experts, gen)
        dtype = torch.float8_e4m3fn if payload == "fp8" else torch.bfloat16
        stage_x = torch.full((world, T, hidden), float("nan")).to(dtype)  # stale rows must never matter
        stage_sf = torch.full((world, T, hidden // 128), float("nan")) if payload == "fp8" else None
        for s in range(world):
            n = int(meta[s, STEP_NUM_TOKENS])
            base = int(meta[s, STEP_TOKEN_BASE])
            stage_x[s, :n] = quant[s][0][base:base + n]
            if stage_sf is not None:
                stage_sf[s, :n] = quant[s][1][base:base + n]
        for dest in range(world):
            plan = plan_step(stage_idx, stage_w, meta, first_expert=dest * E, experts_per_rank=E,
                             block_m=block_m, capacity=capacity)
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
        outs, refs = run_loopback(payload, ns=[0, 5, 37, 16], num_experts=8, world=4, topk=3, tokens_per_slot=8)
        for s, (out, ref) in enumerate(zip(outs, refs)):
            assert bool(torch.isfinite(out).all())
            if ref.numel():
                rel = float((out - ref).norm() / ref.norm())
                assert rel < 1e-2, (payload, s, rel)
