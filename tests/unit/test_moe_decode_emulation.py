"""The decode path's two kernels (device/kernels/moe_decode.cu on chunkring/moe/decode_gemm.cuh), run whole on the
CPU as written (tests/helpers/emulation/decode.py: every block of the launch grid, every thread, the PTX fragment
tables of mma.m16n8k32, fp32 accumulation with the per-k-block scale promotion, bf16 and e4m3 rounding where the
kernels round) and launched by the host's own code - ExpertCompute.experts -> DecodeGemm, then
ExpertCompute.combine_push -> moe_combine_push - on plans in the real layout (groups padded to 128 rows,
group_end in psum form, src -1 on padding rows, rows_sf MN-major, rows in any order inside a group), against a
float64 reference on the dequantised operands. Every load and store is checked in bounds, aligned, reading only
written bytes, and storing no byte twice.

What it pins, per stage, each against the float64 reference with a bound derived from the fp32 arithmetic:
* L1: the fp32 sums the epilogue rounds are rows @ w13[e]^T within (8 + 2 * k blocks) fp32 units of sum |terms|;
* act / act_sf: bit for bit what moe_swiglu_fp8 (the DeepGEMM path's SwiGLU, also emulated) makes of those sums
  rounded to bf16; and against SwiGLU in float64 on the reference's sums rounded to bf16: act_sf = amax / 448
  (1 for a zero block) within fp32 error, each act value within half an e4m3 unit of v / scale;
* L2: each bf16 output lies between the bf16 roundings of (act @ w2[e]^T) -/+ that bound;
* the combine: each real row times its weight, bf16, at (source, token * K + k), nothing else written.

What only a GPU can show (tests/gpu/test_moe_decode.py): that the hardware's fragment layout is the PTX ISA's as
transcribed here, the tensor core's FP8 accumulation precision and order, __expf's and the cvt instructions' exact
bits, the non-coherent and __ldg loads' caching, memory ordering between the launches, registers and speed."""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from chunkring import MoEConfig, PayloadFormat
from chunkring.moe._engine.experts import DevicePlan
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.moe.weights import quantize_weight_fp8
from chunkring.testing.plan import padded_rows_bound, plan_batch
from tests.helpers.emulation import decode as decode_emu
from tests.helpers.emulation import decode_gemm as engine
from tests.helpers.emulation.library import EmulatedLibrary
from tests.helpers.emulation.machine import E4M3_VALUES, EmulatedMemoryError, Memory, round_bf16
from tests.helpers.emulation.plan_layout import expert_compute

U32 = 2.0**-24  # fp32's unit roundoff


@dataclass(frozen=True)
class Case:
    experts: int
    hidden: int
    inter: int
    topk: int
    sources: int
    counts: tuple[int, ...]  # real rows per local expert

    def __str__(self) -> str:
        return f"E{self.experts}-H{self.hidden}-I{self.inter}-K{self.topk}-W{self.sources}-rows{self.counts}"


CASES = [
    Case(1, 256, 128, 1, 1, (64,)),  # 64 rows in one expert: two full passes; L2 one k block
    Case(2, 512, 256, 2, 2, (0, 33)),  # an idle expert; 32 + 1 rows; two L2 chunks; 4 k blocks (< kStages)
    Case(3, 768, 128, 2, 3, (1, 80, 9)),  # a hot expert (3 passes, the last half a pass); L1 k blocks == kStages
    Case(2, 256, 384, 1, 2, (32, 8)),  # passes and token tiles exactly full; L2 3 k blocks
    Case(1, 1792, 896, 1, 1, (20,)),  # both weight rings wrap: L1 14 k blocks, L2 7; a part of a pass
    Case(2, 256, 128, 2, 1, (0, 0)),  # nothing routed here: every block returns at once
]


def quantise_rows(x: torch.Tensor):
    """1x128 e4m3 rows as the producers make them: scale = amax / 448 (1 for a zero block)."""
    blocks = x.view(*x.shape[:-1], -1, 128)
    scale = blocks.abs().amax(-1) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape), scale


def routes(case: Case, tokens: int, gen: torch.Generator):
    """Per-source topk_idx / weights giving local expert e exactly counts[e] choices; the other choices masked
    or, with several ranks, another rank's experts."""
    slots = case.sources * tokens * case.topk
    idx = torch.full((slots,), -1, dtype=torch.int32)
    order = torch.randperm(slots, generator=gen)
    at = 0
    for e, n in enumerate(case.counts):
        idx[order[at:at + n]] = e
        at += n
    if case.sources > 1:
        rest = order[at:][::2]
        idx[rest] = torch.randint(case.experts, case.experts * case.sources, (len(rest),), generator=gen,
                                  dtype=torch.int32)
    idx = idx.view(case.sources, tokens, case.topk)
    w = torch.rand(case.sources, tokens, case.topk, generator=gen) + 0.5
    return list(idx), list(w)


def build(case: Case, seed: int = 0):
    """The layer's config, weights, each source's FP8 rows, and the DevicePlan moe_plan_scatter would fill (host
    reference plan_batch, rows shuffled inside each group as the scatter's atomic cursor may place them)."""
    gen = torch.Generator().manual_seed(seed)
    E, H, inter, K, W = case.experts, case.hidden, case.inter, case.topk, case.sources
    tokens = max(1, -(-sum(case.counts) // (W * K)) + 1)
    config = MoEConfig(num_experts=E * W, hidden=H, intermediate=inter, topk=K, max_tokens_per_rank=tokens,
                       payload=PayloadFormat.FP8_E4M3)

    def weight(n, k):  # block scales spread over 2^-3..2^3, so that a wrong scale index shows
        spread = 2.0 ** torch.randint(-3, 4, (E, n // 128, k // 128), generator=gen).float()
        w = torch.randn(E, n, k, generator=gen) / k**0.5
        return quantize_weight_fp8(w * spread.repeat_interleave(128, 1).repeat_interleave(128, 2))

    w13, w2 = weight(2 * inter, H), weight(H, inter)
    idx, w = routes(case, tokens, gen)
    ref = plan_batch(idx, w, dest_rank=0, world_size=W, num_experts=E * W, block_m=GROUP_ALIGN)
    x = torch.randn(W, tokens, H, generator=gen) * 2.0 ** torch.randint(-4, 5, (W, tokens, 1), generator=gen)
    if ref.num_real_rows:  # a routed token of zeros: its row blocks and its act blocks take scale 1
        first = int(torch.nonzero(ref.src_rank >= 0)[0])
        x[int(ref.src_rank[first]), int(ref.token_index[first])] = 0
    x_fp8, x_sf = quantise_rows(x)
    P = padded_rows_bound(tokens, K, W, E, GROUP_ALIGN)
    order = torch.arange(ref.num_padded_rows)
    for e in range(E):
        lo, n = int(ref.expert_offsets[e]), int(ref.counts[e])
        order[lo:lo + n] = lo + torch.randperm(n, generator=gen)
    plan = DevicePlan(counts=ref.counts.int(), group_end=(ref.expert_offsets[:-1] + ref.counts).int(),
                      src=torch.full((P,), -1, dtype=torch.int32), token=torch.zeros(P, dtype=torch.int32),
                      k=torch.zeros(P, dtype=torch.int32), weight=torch.zeros(P),
                      rows=torch.zeros((P, H), dtype=torch.uint8), rows_sf=torch.zeros((H // 128, P)),
                      own_row=torch.full((tokens * K,), -1, dtype=torch.int32))
    real = torch.nonzero(ref.src_rank[order] >= 0).flatten()
    picked = order[real]
    plan.src[real], plan.k[real], plan.weight[real] = ref.src_rank[picked], ref.topk_pos[picked], ref.weight[picked]
    plan.token[real] = ref.token_index[picked].int()
    s, tk = plan.src[real].long(), plan.token[real].long()
    plan.rows[real] = x_fp8[s, tk].view(torch.uint8)
    plan.rows_sf[:, real] = x_sf[s, tk].T
    return config, w13, w2, plan, real.numpy(), tokens


def register(memory: Memory, plan: DevicePlan, real: np.ndarray, w13, w2) -> None:
    """The inputs as the device holds them: moe_plan_scatter wrote only the real rows of rows, rows_sf, token, k,
    weight (the host prefilled src with -1); the rest is torch.empty's."""
    for name, t in (("counts", plan.counts), ("group_end", plan.group_end), ("src", plan.src), ("w13", w13.data),
                    ("w13_sf", w13.scale), ("w2", w2.data), ("w2_sf", w2.scale)):
        memory.add(t, name)
    P, H = plan.rows.shape
    for name, t in (("rows", plan.rows), ("token", plan.token), ("k", plan.k), ("weight", plan.weight)):
        a = memory.add(t, name, initialised=False)
        a.valid.reshape(P, -1)[real] = True
    a = memory.add(plan.rows_sf, "rows_sf", initialised=False)
    a.valid.reshape(H // 128, P, 4)[:, real] = True


def run(case: Case, monkeypatch, *, corrupt=None):
    """ExpertCompute's decode path and combine push on the emulated kernels, as the layer enqueues them."""
    config, w13, w2, plan, real, tokens = build(case)
    if corrupt is not None:
        corrupt(plan)
    memory, trace = Memory(), []
    library = EmulatedLibrary(memory, decode_emu.kernels(trace))
    register(memory, plan, real, w13, w2)
    combine = [torch.full((tokens * case.topk, case.hidden), float("nan"), dtype=torch.bfloat16)
               for _ in range(case.sources)]
    for s, c in enumerate(combine):
        memory.add(c, f"combine[{s}]")
    peer_combine = torch.tensor([c.data_ptr() for c in combine], dtype=torch.int64)
    memory.add(peer_combine, "peer_combine")
    compute = expert_compute(config, case.sources, 0, case.experts, library, monkeypatch)
    decode = compute.decode
    memory.add(compute.pushed, "pushed")  # zeroed by the layer before the call's first push
    out = compute.experts(plan, w13, w2)
    compute.combine_push(plan, out, peer_combine)
    return types.SimpleNamespace(case=case, config=config, w13=w13, w2=w2, plan=plan, real=real, memory=memory,
                                 library=library, trace=trace, out=out, combine=combine, decode=decode,
                                 pushed=int(compute.pushed), push_grid=compute.push_blocks)


def dequantised(data: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """float64 [E, N, K] of an Fp8Weight: e4m3 value times its 128x128 block's scale, exactly."""
    values = E4M3_VALUES[data.view(torch.uint8).numpy()]
    return values * scale.double().numpy().repeat(128, 1).repeat(128, 2)


def expert_of_rows(r) -> np.ndarray:
    """The local expert of each real row (from the plan's groups)."""
    first = (r.plan.group_end - r.plan.counts).numpy()
    return np.searchsorted(first, r.real, side="right") - 1


def bf16_interval(exact: np.ndarray, bound: np.ndarray):
    """The bf16 values an fp32 number within ``bound`` of ``exact`` can round to: [rn(lo), rn(hi)], lo and hi
    widened to fp32 outward (rounding is monotone)."""
    lo, hi = (exact - bound).astype(np.float32), (exact + bound).astype(np.float32)
    lo = np.where(lo > exact - bound, np.nextafter(lo, np.float32(-np.inf)), lo)
    hi = np.where(hi < exact + bound, np.nextafter(hi, np.float32(np.inf)), hi)
    return round_bf16(lo), round_bf16(hi)


def traced_sums(r) -> np.ndarray:
    """fp32 [real rows, 2I] (gate columns, then up): the sums L1's epilogue rounded, each (row, column) once."""
    inter = r.case.inter
    where = {int(p): i for i, p in enumerate(r.real)}
    sums = np.full((len(r.real), 2 * inter), np.nan, np.float32)
    seen = np.zeros((len(r.real), inter), np.int64)
    for rows_t, cols_t, gate, up in r.trace:
        i = np.array([where[int(p)] for p in rows_t], np.int64)
        np.add.at(seen, (i, cols_t), 1)
        sums[i, cols_t], sums[i, inter + cols_t] = gate, up
    assert (seen == 1).all(), "every (real row, column) of act exactly once"
    return sums


def check_l1(r, sums: np.ndarray) -> np.ndarray:
    """L1's fp32 sums against rows @ w13[e]^T in float64. Returns the latter."""
    H = r.case.hidden
    x = E4M3_VALUES[r.plan.rows.numpy()[r.real]] * r.plan.rows_sf.double().numpy()[:, r.real].T.repeat(128, 1)
    w = dequantised(r.w13.data, r.w13.scale)[expert_of_rows(r)]  # [rows, 2I, H]
    exact = np.einsum("rk,rnk->rn", x, w)
    # Each MMA step and each promotion rounds once to fp32: a few units of fp32 roundoff of the sum of |terms|.
    bound = (8 + 2 * H // 128) * U32 * np.einsum("rk,rnk->rn", np.abs(x), np.abs(w)) + 1e-30
    err = np.abs(sums - exact)
    assert (err <= bound).all(), f"L1 off by {np.max(err / bound):.3g} x the fp32 bound"
    return exact


def swiglu_fp8(r, gate_up_rows: np.ndarray):
    """moe_swiglu_fp8 (emulated, launched as ExpertCompute's DeepGEMM path launches it) on bf16 gate_up whose real
    rows are ``gate_up_rows``: (act, act_sf) tensors and the act allocation."""
    P, inter = r.plan.rows.shape[0], r.case.inter
    gate_up = torch.zeros((P, 2 * inter), dtype=torch.bfloat16)
    gate_up[r.real] = torch.from_numpy(gate_up_rows).to(torch.bfloat16)
    r.memory.add(gate_up, "gate_up", initialised=False).valid.reshape(P, -1)[r.real] = True  # the GEMM's real rows
    act = torch.empty((P, inter), dtype=torch.float8_e4m3fn)
    act_sf = torch.empty((inter // 128, P), dtype=torch.float32)
    r.library.launch("moe_swiglu_fp8", gate_up=gate_up, inter=inter, act=act, act_sf=act_sf, sf_stride=P, grid=8,
                     block=256, shared_bytes=4 * (r.case.experts + 1), **r.plan.group_args())
    return act, act_sf, r.memory.find(act)


def check_act_is_moe_swiglu_fp8(r, sums: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """act / act_sf as L1 wrote them are, bit for bit and row for row, what moe_swiglu_fp8 (the DeepGEMM path's
    activation) makes of the same sums as bf16 gate_up."""
    l1_args = r.library.launches[0][3]["args"]
    act, act_sf = l1_args["act"], l1_args["act_sf"]
    want, want_sf, want_alloc = swiglu_fp8(r, sums)
    assert np.array_equal(r.memory.find(act).valid, want_alloc.valid)
    assert np.array_equal(r.memory.find(act_sf).valid, r.memory.find(want_sf).valid)
    assert torch.equal(act.view(torch.uint8)[r.real], want.view(torch.uint8)[r.real])
    assert torch.equal(act_sf[:, r.real], want_sf[:, r.real])
    return act, act_sf


def check_act_against_float64(r, exact: np.ndarray, sums: np.ndarray, act, act_sf) -> None:
    """act against SwiGLU in float64 on the reference's sums rounded to bf16: scale = amax / 448 per 1x128 (1 for
    a zero block), each value the e4m3 rounding of v / scale. Rows where a bf16 rounding of the fp32 sums and of
    the exact ones differ are left out (their inputs differ by a bf16 unit); they must be rare."""
    inter = r.case.inter
    flips = (round_bf16(sums) != round_bf16(exact.astype(np.float32))).any(axis=1)
    assert flips.sum() <= max(1, len(r.real) // 4), "fp32 sums rarely straddle a bf16 rounding point"
    gu = round_bf16(exact[~flips].astype(np.float32)).astype(np.float64)
    v = gu[:, :inter] / (1 + np.exp(-gu[:, :inter])) * gu[:, inter:]
    amax = np.abs(v).reshape(len(v), inter // 128, 128).max(axis=2, initial=0.0)
    scale = np.where(amax > 0, amax / 448, 1.0)
    got_sf = act_sf.double().numpy()[:, r.real[~flips]].T
    assert np.allclose(got_sf, scale, rtol=2e-6, atol=0), "act_sf = amax / 448 (fp32 SwiGLU: a few fp32 units)"
    q = v / scale.repeat(128, axis=1)
    got = E4M3_VALUES[act.view(torch.uint8).numpy()[r.real[~flips]]]
    # Half an e4m3 unit (3 mantissa bits, subnormal below 2^-6) of the larger of the two, and the fp32 slack.
    half_unit = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(q), np.abs(got)) + 1e-300)), -6) - 4)
    assert (np.abs(got - q) <= half_unit + 4e-6 * np.abs(q)).all(), "act = e4m3(v / scale)"


def check_l2(r, act, act_sf) -> None:
    """L2's bf16 rows against act @ w2[e]^T (the act L1 wrote), within the fp32 bound; only real rows written."""
    H, inter, P = r.case.hidden, r.case.inter, r.plan.rows.shape[0]
    x = E4M3_VALUES[act.view(torch.uint8).numpy()[r.real]] * act_sf.double().numpy()[:, r.real].T.repeat(128, 1)
    w = dequantised(r.w2.data, r.w2.scale)[expert_of_rows(r)]
    exact = np.einsum("rk,rnk->rn", x, w)
    bound = (8 + 2 * inter // 128) * U32 * np.einsum("rk,rnk->rn", np.abs(x), np.abs(w)) + 1e-30
    lo, hi = bf16_interval(exact, bound)
    got = r.out.float().numpy()[r.real]
    assert ((lo <= got) & (got <= hi)).all(), f"{((got < lo) | (got > hi)).sum()} L2 outputs out of bounds"
    written = r.memory.find(r.out).valid.reshape(P, 2 * H)
    assert written[r.real].all() and written.sum() == len(r.real) * 2 * H, "L2 writes exactly the real rows"


def check_combine(r) -> None:
    """Each real row of out times its weight, rounded to bf16, at (source, token * K + k); the rest untouched."""
    K = r.case.topk
    want = [torch.full_like(c, float("nan")) for c in r.combine]
    for p in r.real:
        s, slot = int(r.plan.src[p]), int(r.plan.token[p]) * K + int(r.plan.k[p])
        want[s][slot] = (r.out[p].float() * r.plan.weight[p]).to(torch.bfloat16)
    for got, expected in zip(r.combine, want, strict=True):
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert r.pushed == r.push_grid  # one arrival per block of the push


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_decode_kernels_compute_the_layers_expert_work(case, monkeypatch):
    r = run(case, monkeypatch)
    names = [(name, grid, block) for name, grid, block, _ in r.library.launches]
    l1, l2 = r.decode.grids()
    assert names == [("moe_decode_l1", l1, 256), ("moe_decode_l2", l2, 256), ("moe_combine_push", 8, 256)]
    sums = traced_sums(r)
    exact = check_l1(r, sums)
    act, act_sf = check_act_is_moe_swiglu_fp8(r, sums)
    check_act_against_float64(r, exact, sums, act, act_sf)
    check_l2(r, act, act_sf)
    check_combine(r)


def test_a_group_boundary_off_by_one_is_caught(monkeypatch):
    """Not vacuous: a group_end one row late makes L1 read the group's first padding row, which nothing wrote."""
    def late(plan):
        plan.group_end[1] += 1

    with pytest.raises(EmulatedMemoryError, match="uninitialised bytes of rows"):
        run(CASES[1], monkeypatch, corrupt=late)


@pytest.mark.parametrize("broken", ["a wait one group short", "copies one block further ahead"])
def test_a_broken_weight_pipeline_is_caught(monkeypatch, broken):
    """Not vacuous: the ring refuses a read of a k block whose copy group is still in flight (a wait that leaves one
    group too many), and of a slot whose block was replaced (copies issued one block further ahead)."""
    if broken == "a wait one group short":
        wait = engine.Ring.wait
        monkeypatch.setattr(engine.Ring, "wait", lambda ring, pending: wait(ring, pending + 1))
    else:
        copy = engine.copy_weights
        monkeypatch.setattr(engine, "copy_weights",
                            lambda ring, op, kb, t: copy(ring, op, kb + (kb >= engine.STAGES), t))
    with pytest.raises(EmulatedMemoryError, match="weight ring"):
        run(CASES[4], monkeypatch)


def test_what_the_kernel_ahead_writes_is_read_only_after_the_wait(monkeypatch):
    """Not vacuous: before wait_prior_grid a block reads only its expert's count and the weights (it starts its first
    weight copies there); the emulated kernels hand out every other operand only after the wait, so a kernel that
    never waited is refused at its first such read."""
    monkeypatch.setattr(decode_emu.Prior, "wait", lambda prior: None)
    with pytest.raises(EmulatedMemoryError, match="read before wait_prior_grid"):
        run(CASES[1], monkeypatch)
