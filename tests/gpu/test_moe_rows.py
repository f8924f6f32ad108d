"""The MoE layer's row kernels (device/kernels/moe_stream.cu) against their torch reference
(chunkring.moe.dispatch): moe_gather_rows bit for bit on every real row, FP8 and bf16 payloads;
moe_swiglu within bf16 rounding. Padding rows are theirs to skip: only real rows are compared."""

import pytest
import torch
import torch.nn.functional as F

from chunkring._jit import library_for
from chunkring.moe.dispatch import padded_rows_bound, plan_experts
from chunkring.testing.reference import gather_rows
from chunkring.moe.layer import moe_kernel_signatures

pytestmark = pytest.mark.gpu

W, N, H, K, E, INTER, BLOCK_M = 3, 40, 512, 4, 5, 192, 16


def planned_stage(payload: str, device):
    """A stage as moe_pull leaves it (some rows never pulled: -1) and the plan of its rows at rank 0."""
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 2 * E, (W, N, K), generator=gen, dtype=torch.int32)
    idx[:, N - 7:] = -1  # rows no chunk brought
    x32 = torch.randn(W, N, H, generator=gen) * 3
    if payload == "fp8":
        sf = torch.rand(W, N, H // 128, generator=gen) + 0.01
        x = (x32 / sf.repeat_interleave(128, dim=-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        sf, x = torch.zeros(W, N, 0), x32.to(torch.bfloat16)
    capacity = padded_rows_bound(N, K, W, E, BLOCK_M)
    plan = plan_experts(idx.to(device), torch.rand(W, N, K, generator=gen).to(device), first_expert=0,
                        experts_per_rank=E, block_m=BLOCK_M, capacity=capacity)
    return x.to(device), sf.to(device), plan, capacity


@pytest.mark.parametrize("payload", ["fp8", "bf16"])
def test_gather_rows_kernel_is_the_reference_bit_for_bit(runtime, payload):
    device = runtime.torch_device
    x, sf, plan, capacity = planned_stage(payload, device)
    kernels = library_for(runtime, "moe_stream", moe_kernel_signatures())
    rows = torch.full((capacity, H), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.launch("moe_gather_rows", x.view(torch.uint8), sf, plan.src_rank, plan.token_index, rows, N, H,
                   int(payload == "fp8"), grid=capacity, block=128)
    want = gather_rows(plan, x, sf if payload == "fp8" else None)
    real = plan.real
    assert int(real.sum()) > 50
    assert torch.equal(rows[real], want[real])


def test_swiglu_kernel_matches_the_reference(runtime):
    device = runtime.torch_device
    _, _, plan, capacity = planned_stage("bf16", device)
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(capacity, 2 * INTER, generator=gen) * 4).to(torch.bfloat16).to(device)
    kernels = library_for(runtime, "moe_stream", moe_kernel_signatures())
    act = torch.full((capacity, INTER), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.launch("moe_swiglu", gate_up, act, plan.src_rank, INTER, grid=capacity, block=128)
    want = (F.silu(gate_up[:, :INTER].float()) * gate_up[:, INTER:].float()).to(torch.bfloat16)
    real = plan.real
    diff = (act[real].float() - want[real].float()).abs()
    assert float(diff.max()) <= 2 ** -7 * float(want[real].float().abs().max()), "beyond bf16 rounding"
    assert bool(torch.isfinite(act[real]).all())
