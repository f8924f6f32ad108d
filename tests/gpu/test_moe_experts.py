"""The consumer's expert work (chunkring.moe._engine.experts, device/kernels/moe_experts.cu) on a staged call,
without the ring: the device plan against the host planner (chunkring.testing.plan.plan_batch), group by
group as sets (a group's rows take places by an atomic cursor), with every row's payload and scales
copied bit for bit into the GEMM layout; and the expert outputs of every planned row against the fp32
reference of the recipe, FP8 (DeepGEMM) and bf16 (torch grouped GEMM) payloads."""

import pytest
import torch
import torch.nn.functional as F

from chunkring import MoEConfig, PayloadFormat
from chunkring.jit import library_for
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe._engine.stage import Stage
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.moe.weights import quantize_weight_fp8
from chunkring.testing.plan import plan_batch
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128

pytestmark = pytest.mark.gpu

W, N, K, E_LOCAL, H, INTER = 3, 40, 4, 5, 256, 128


def staged_call(payload: PayloadFormat, device):
    """A stage as moe_pull leaves it for rank 1 of 3 (rows no chunk brought: -1), its fp32 payload."""
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, W * E_LOCAL, (W, N, K), generator=gen, dtype=torch.int32)
    idx[0, :3] = E_LOCAL + 1  # one expert of rank 1 named twice by a token: each (token, k) is a row
    idx[:, N - 7:] = -1
    w = torch.rand(W, N, K, generator=gen)
    x32 = torch.randn(W, N, H, generator=gen) * 3
    if payload.has_scales:
        xq, sf = quantize_fp8_per128(x32.reshape(W * N, H))
        x, sf, x_in = xq.reshape(W, N, H), sf.reshape(W, N, H // 128), dequantize_fp8_per128(xq, sf).reshape(W, N, H)
    else:
        x, sf = x32.to(torch.bfloat16), torch.zeros(W, N, 0)
        x_in = x.float()
    stage = Stage(x.to(device), sf.to(device), idx.to(device), w.to(device), expert_lo=E_LOCAL, expert_hi=2 * E_LOCAL)
    return stage, x_in


def compute_for(runtime, payload):
    cfg = MoEConfig(num_experts=W * E_LOCAL, hidden=H, intermediate=INTER, topk=K, max_tokens_per_rank=N,
                    payload=payload)
    return ExpertCompute(cfg, W, E_LOCAL, E_LOCAL, library_for(runtime, "moe_experts"), runtime.torch_device)


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16], ids=["fp8", "bf16"])
def test_device_plan_is_the_host_plan_with_the_payload_in_the_gemm_layout(runtime, payload):
    compute = compute_for(runtime, payload)
    stage, _ = staged_call(payload, runtime.torch_device)
    plan = compute.plan(stage)
    torch.cuda.synchronize()
    host = plan_batch(list(stage.idx.cpu()), list(stage.w.cpu()), dest_rank=1, world_size=W,
                      num_experts=W * E_LOCAL, block_m=GROUP_ALIGN)
    assert plan.counts.cpu().tolist() == host.counts.tolist()
    offsets = host.expert_offsets.tolist()
    assert plan.group_end.cpu().tolist() == [offsets[e] + int(host.counts[e]) for e in range(E_LOCAL)]
    src, token, k, weight = (t.cpu() for t in (plan.src, plan.token, plan.k, plan.weight))
    used = offsets[-1]
    assert bool((src[used:] == -1).all()), "rows past the last group must stay padding"
    for e in range(E_LOCAL):
        lo, count = offsets[e], int(host.counts[e])
        assert bool((src[lo + count:offsets[e + 1]] == -1).all()), f"expert {e}: padding rows marked real"
        got = sorted(zip(src[lo:lo + count].tolist(), token[lo:lo + count].tolist(), k[lo:lo + count].tolist(),
                         weight[lo:lo + count].tolist(), strict=True))
        want = sorted(zip(host.src_rank[lo:lo + count].tolist(), host.token_index[lo:lo + count].tolist(),
                          host.topk_pos[lo:lo + count].tolist(), host.weight[lo:lo + count].tolist(),
                          strict=True))
        assert got == want, f"expert {e}: the device plan's rows differ from the host plan's"
    real = torch.nonzero(src >= 0).flatten()
    rows = plan.rows.cpu()[real]
    want_rows = stage.x.view(torch.uint8).cpu()[src[real].long(), token[real].long()]
    assert torch.equal(rows, want_rows), "a row's payload was not copied bit for bit"
    if payload.has_scales:
        got_sf = plan.rows_sf.cpu()[:, real].t()
        assert torch.equal(got_sf, stage.sf.cpu()[src[real].long(), token[real].long()])


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16], ids=["fp8", "bf16"])
def test_expert_outputs_of_every_planned_row_match_the_recipe(runtime, payload):
    """out[p] = w2[e] @ act(w13[e] @ row p), act = silu(gate) * up; on the FP8 path as the recipe rounds:
    L1's output to bf16, act to e4m3 per 1x128. Held to 1e-2 relative against fp32 on the dequantised
    operands: what remains is L2's bf16 output (2^-9) and accumulation order."""
    device = runtime.torch_device
    compute = compute_for(runtime, payload)
    stage, x_in = staged_call(payload, device)
    gen = torch.Generator().manual_seed(4)
    w13 = (torch.randn(E_LOCAL, 2 * INTER, H, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E_LOCAL, H, INTER, generator=gen) / INTER**0.5).to(torch.bfloat16)
    if payload.has_scales:
        q13, q2 = quantize_weight_fp8(w13.to(device)), quantize_weight_fp8(w2.to(device))
        args, w13_ref, w2_ref = (q13, q2), q13.dequantize(), q2.dequantize()
    else:
        args, w13_ref, w2_ref = (w13.to(device), w2.to(device)), w13.float().to(device), w2.float().to(device)
    plan = compute.plan(stage)
    out = compute.experts(plan, *args)
    torch.cuda.synchronize()
    src = plan.src
    real = torch.nonzero(src >= 0).flatten()
    ends = plan.group_end.tolist()
    starts = [e_end - c for e_end, c in zip(ends, plan.counts.tolist(), strict=True)]
    expert = torch.empty_like(src)
    for e, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        expert[lo:hi] = e
    rows = x_in.to(device)[src[real].long(), plan.token[real].long()]
    e_of = expert[real].long()
    gate_up = torch.einsum("rh,rnh->rn", rows, w13_ref[e_of])
    if payload.has_scales:
        gate_up = gate_up.to(torch.bfloat16).float()  # L1's output type
    act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
    if payload.has_scales:
        act = dequantize_fp8_per128(*quantize_fp8_per128(act))
    ref = torch.einsum("ri,rhi->rh", act, w2_ref[e_of])
    got = out[real].float()
    assert not bool(torch.isnan(got).any())
    err = float((got - ref).norm() / ref.norm())
    print(f"{payload.name}: expert outputs relative error {err:.2e} over {real.numel()} rows")
    assert err <= 1e-2
