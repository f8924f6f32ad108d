"""The persistent decode consumer (chunkring.moe._engine.persistent, device/kernels/moe_persistent.cu) on the GPU,
on the plans the layer builds (moe_plan_scatter through ExpertCompute.plan):

* its bf16 rows match the fp32 reference of the recipe within the tolerance the decode path is held to (1e-2
  relative), and today's decode kernels' rows within it, at 1, 8, 32 and 128 tokens, hidden 4096 and 7168 - with
  experts that have no rows and experts that take several passes; its activation (act, act_sf) matches the
  reference's quantised one; the plan's other rows are left as they were;
* every variant - fused or an L1 and an L2 launch, each claim order, shallow rings, fewer blocks, w13 in 16 boxes -
  gives the same bits, and narrower token tiles (more passes) the same rows within the tolerance; a second run gives
  the same bits, as do launches back to back (each a dependent launch), and a CUDA-graph replay the eager call's;
  w13 in 16 boxes matches the reference on its own;
* the device timeline: every block wrote its record on its own SM, ran the units the schedule's mirror gives it, in
  time order;
* a wait that gives up leaves its fault word in host memory and fails the process (in a child: a trap ends the
  context; outside MPS, whose clients a trap would all end);
* the dynamic claim needs no block resident beside another: one block per SM of the GPU, fused, on a green context
  of 8 SMs, gives the whole GPU's bits; the strided claim there waits for L1 units of blocks that cannot start and
  gives up (the negative control, in a child).

Where ranks share the GPU (under MPS) their launches hold each other's SMs, which a fused launch's waits under a
static claim cannot allow: there every rank runs the layer's variant (the dynamic claim) as its default and the fused
static ones are left to a GPU of one rank; the children, which show a property of one launch, run on rank 0 only.

Records: tests/gpu_results/*-persistent-1rank.json (scripts/gpu_suite.sh part persistent_1rank)."""

import textwrap

import pytest
import torch

from chunkring import MoEConfig, SmPartition
from chunkring.jit import library_for
from chunkring.moe._engine.decode import DecodeGemm
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe._engine.persistent import (
    LAYER_VARIANT,
    TIMELINE_WORDS,
    PersistentGemm,
    PersistentVariant,
    block_units,
)
from tests.gpu.moe_helpers import rel_error
from tests.gpu.plan_helpers import ACTIVE, E_LOCAL, INTER, TOPK, expert_weights_fp8, reference, staged
from tests.helpers.processes import run_trapping_child

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-2  # the decode path's bound against the same reference (tests/gpu/test_moe_decode.py)


def setup(runtime, hidden, n, seed=0):
    """The layer's plan of n staged tokens, the weights, today's decode path and the persistent consumer."""
    device = runtime.torch_device
    cfg = MoEConfig(num_experts=E_LOCAL, hidden=hidden, intermediate=INTER, topk=TOPK, max_tokens_per_rank=n)
    decode = ExpertCompute(cfg, 1, 0, E_LOCAL, library_for(runtime, "moe_experts"), device,
                           decode=DecodeGemm(library_for(runtime, "moe_decode"), cfg, E_LOCAL))
    stage, x_in = staged(n, hidden, device, seed=n + hidden + seed)
    q13, q2 = expert_weights_fp8(hidden, device, seed=hidden)
    plan = decode.plan(stage)
    variant = PersistentVariant()
    if not runs_here(runtime, variant):  # the default claim is a static one
        variant = LAYER_VARIANT
    return plan, x_in, q13, q2, decode, PersistentGemm(library_for(runtime, "moe_persistent"), cfg, E_LOCAL,
                                                       variant=variant)


def runs_here(runtime, variant: PersistentVariant) -> bool:
    """Whether ``variant`` can run on this rank's GPU: a fused launch under a static claim has L2 units wait for
    other blocks' L1 units, so it needs every block resident - which other ranks' launches, holding SMs, prevent."""
    return runtime.gpu_ranks == 1 or not variant.fused or variant.claim == "dynamic"


def run(gemm, plan, q13, q2, **kwargs):
    """The persistent consumer's rows on a NaN-filled output (untouched rows stay NaN), and its activation."""
    out = torch.full((plan.rows.shape[0], gemm.config.hidden), float("nan"), dtype=torch.bfloat16,
                     device=plan.rows.device)
    act, act_sf = gemm(plan, q13, q2, out, **kwargs)
    torch.cuda.synchronize()
    return out, act, act_sf


@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("n", [1, 8, 32, 128])
def test_rows_and_activation_match_the_reference_and_the_decode_path(runtime, hidden, n):
    plan, x_in, q13, q2, decode, gemm = setup(runtime, hidden, n)
    out, act, act_sf = run(gemm, plan, q13, q2)
    out_decode = decode.experts(plan, q13, q2)
    torch.cuda.synchronize()
    counts = plan.counts.tolist()
    assert counts[ACTIVE:] == [0] * (E_LOCAL - ACTIVE), "the idle experts must have no rows"
    if n >= 128:
        assert max(counts) > gemm.variant.tile_cap, "an expert must take more than one pass"
    real, ref, ref_act = reference(plan, x_in, q13, q2)
    got = out[real].float()
    err, between = rel_error(got, ref), rel_error(got, out_decode[real].float())
    scales = act_sf[:, real].t().repeat_interleave(128, 1)
    err_act = rel_error(act[real].float() * scales, ref_act)
    print(f"hidden {hidden}, {n} tokens: persistent {err:.2e}, against the decode path {between:.2e}, "
          f"activation {err_act:.2e}")
    assert err <= TOLERANCE and between <= TOLERANCE and err_act <= TOLERANCE
    others = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    others[real] = False
    assert bool(torch.isnan(out[others].float()).all()), "a row outside the plan's groups was written"


def test_sixteen_boxes_an_l1_tile_match_the_reference(runtime):
    """w13_boxes 16 (w13's map in its own dimension order, 8-row boxes) on its own: the reference, not the default."""
    plan, x_in, q13, q2, _, gemm = setup(runtime, 7168, 32, seed=1)
    out, _, _ = run(gemm, plan, q13, q2, variant=gemm.with_variant(w13_boxes=16))
    real, ref, _ = reference(plan, x_in, q13, q2)
    assert rel_error(out[real].float(), ref) <= TOLERANCE


#: Variants whose arithmetic is the default's, step for step: the same bits.
SAME_BITS = [dict(fused=False), dict(claim="strided_blocks"), dict(claim="blocked"), dict(stages=2, token_stages=1),
             dict(stages=12, token_stages=3), dict(sms=33), dict(w13_boxes=16), dict(claim="blocked", sms=7),
             # the dynamic claim: fused and in two launches, fewer blocks than experts' units
             dict(claim="dynamic"), dict(claim="dynamic", fused=False), dict(claim="dynamic", sms=7)]


def test_every_variant_gives_the_same_rows(runtime):
    plan, x_in, q13, q2, _, gemm = setup(runtime, 4096, 40)
    base, base_act, _ = run(gemm, plan, q13, q2)
    real, ref, _ = reference(plan, x_in, q13, q2)
    again, _, _ = run(gemm, plan, q13, q2)
    assert torch.equal(again[real], base[real]), "a rerun on the same plan differs"
    for variant in (gemm.with_variant(**change) for change in SAME_BITS):
        if runs_here(runtime, variant):
            out, act, _ = run(gemm, plan, q13, q2, variant=variant)
            assert torch.equal(out[real], base[real]) and torch.equal(act[real], base_act[real]), variant
    for cap in (8, 16):  # passes of 8 or 16 rows: other token tiles
        out, _, _ = run(gemm, plan, q13, q2, variant=gemm.with_variant(tile_cap=cap))
        assert rel_error(out[real].float(), base[real].float()) <= TOLERANCE / 10, cap
        assert rel_error(out[real].float(), ref) <= TOLERANCE, cap


def test_a_graph_replay_gives_the_eager_calls_rows(runtime):
    plan, _, q13, q2, _, gemm = setup(runtime, 4096, 24)
    eager, _, _ = run(gemm, plan, q13, q2)
    out = torch.zeros_like(eager)
    gemm(plan, q13, q2, out)  # warm: the maps are encoded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(plan, q13, q2, out)
    real = torch.nonzero(plan.src >= 0).flatten()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[real], eager[real])


def test_launches_back_to_back_give_one_calls_bits(runtime):
    """A launch is a dependent of the one ahead, which lets it start once its own wait returned: its blocks may be
    placed while that one runs, but touch the counters both use only after it ended. Calls back to back with
    no synchronisation between them - fused, split (its L2 launch a dependent of its L1 launch) and under the
    dynamic claim - give the bits of a call alone."""
    plan, _, q13, q2, _, gemm = setup(runtime, 4096, 24)
    real = torch.nonzero(plan.src >= 0).flatten()
    for variant in (gemm.variant, gemm.with_variant(fused=False), gemm.with_variant(claim="dynamic")):
        alone, _, _ = run(gemm, plan, q13, q2, variant=variant)
        outs = [torch.zeros_like(alone) for _ in range(4)]
        for out in outs:
            gemm(plan, q13, q2, out, variant=variant)
        torch.cuda.synchronize()
        assert all(torch.equal(out[real], alone[real]) for out in outs), variant


def test_the_timeline_holds_each_blocks_units(runtime):
    plan, _, q13, q2, _, gemm = setup(runtime, 4096, 32)
    # A static claim's units per block, from the schedule's mirror.
    statics = (gemm.with_variant(claim="strided_experts"), gemm.with_variant(claim="blocked", sms=40))
    for variant in [v for v in statics if runs_here(runtime, v)]:
        grid = gemm.grid(variant)
        timeline = torch.zeros((grid, TIMELINE_WORDS), dtype=torch.int64, device=plan.rows.device)
        run(gemm, plan, q13, q2, variant=variant, timeline=timeline)
        rec = timeline.cpu()
        blocks = block_units(plan.counts.tolist(), hidden=4096, inter=INTER, claim=variant.claim, grid=grid)
        assert [int(r[5]) for r in rec] == [sum(g == "L1" for g, _, _ in units) for units in blocks]
        assert [int(r[6]) for r in rec] == [sum(g == "L2" for g, _, _ in units) for units in blocks]
        assert len(set(rec[:, 7].tolist())) == grid, "one block per SM"
        assert_spans(rec, blocks)
    # The dynamic claim: every unit run once, by whichever block took it.
    dynamic = gemm.with_variant(claim="dynamic")
    timeline = torch.zeros((gemm.grid(dynamic), TIMELINE_WORDS), dtype=torch.int64, device=plan.rows.device)
    run(gemm, plan, q13, q2, variant=dynamic, timeline=timeline)
    units = [u for block in block_units(plan.counts.tolist(), hidden=4096, inter=INTER, claim="dynamic", grid=1)
             for u in block]
    rec = timeline.cpu()
    assert int(rec[:, 5].sum()) == sum(g == "L1" for g, _, _ in units)
    assert int(rec[:, 6].sum()) == sum(g == "L2" for g, _, _ in units)


def assert_spans(rec: torch.Tensor, blocks: list) -> None:
    """Each block's timestamps inside its own start and end, those of the units it ran set."""
    for r, units in zip(rec.tolist(), blocks, strict=True):
        start, first, last_l1, last_l2, end = r[:5]
        assert start <= end and all(start <= t <= end for t in (first, last_l1, last_l2) if t)
        if units:
            assert first > 0 and (last_l2 if units[-1][0] == "L2" else last_l1) > 0


CHILD = textwrap.dedent("""
    import sys, torch, chunkring
    from chunkring import MoEConfig
    from chunkring.jit import library_for
    from chunkring.moe._engine.persistent import PersistentGemm
    from chunkring.moe.weights import quantize_weight_fp8
    runtime = chunkring.init()
    device = runtime.torch_device
    E, H, I, P = 2, 256, 128, 128
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, topk=1, max_tokens_per_rank=8)
    gemm = PersistentGemm(library_for(runtime, "moe_persistent"), cfg, E, wait_limit_ns=1)
    class Plan:
        counts = torch.tensor([8, 0], dtype=torch.int32, device=device)
        group_end = torch.tensor([8, 128], dtype=torch.int32, device=device)
        rows = torch.zeros((P, H), dtype=torch.uint8, device=device)
        rows_sf = torch.ones((H // 128, P), device=device)
    w13 = quantize_weight_fp8(torch.randn(E, 2 * I, H, device=device))
    w2 = quantize_weight_fp8(torch.randn(E, H, I, device=device))
    try:
        for _ in range(20):  # a 1 ns limit: some wait gives up, at the latest when the weights come from HBM
            gemm(Plan, w13, w2, torch.empty((P, H), dtype=torch.bfloat16, device=device))
            torch.cuda.synchronize()
    except Exception as exc:
        print("launch failed:", type(exc).__name__)
        print("fault:", gemm.fault())
        sys.exit(3)
    print("no fault")
""")


def one_child(runtime) -> None:
    """Skip on every rank but rank 0: a child shows a property of one launch, whatever the job's ranks."""
    if runtime.rank > 0:
        pytest.skip("rank 0's child shows it")


def test_a_wait_that_gives_up_leaves_its_fault_and_fails(runtime):
    one_child(runtime)
    done = run_trapping_child(CHILD)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "fault: block" in done.stdout, done.stdout + done.stderr


#: Blocks a green context of this many SMs runs at once: one per SM.
NARROW_SMS = 8


def test_the_dynamic_claim_needs_no_block_resident_beside_another(runtime):
    plan, _, q13, q2, _, gemm = setup(runtime, 4096, 32)
    dynamic = gemm.with_variant(claim="dynamic")
    assert gemm.grid(dynamic) > NARROW_SMS
    wide, _, _ = run(gemm, plan, q13, q2, variant=dynamic)
    real = torch.nonzero(plan.src >= 0).flatten()
    with SmPartition(runtime, producer_sms=NARROW_SMS) as part:
        part.producer_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(part.producer_stream):  # every block of the launch, at most 8 running at a time
            narrow, _, _ = run(gemm, plan, q13, q2, variant=dynamic)
    assert torch.equal(narrow[real], wide[real])


NARROW_CHILD = textwrap.dedent(f"""
    import os, torch, chunkring
    from chunkring import SmPartition
    from tests.gpu.test_moe_persistent import run, setup
    runtime = chunkring.init()
    plan, _, q13, q2, _, gemm = setup(runtime, 4096, 32)
    gemm.wait_limit_ns = 2_000_000_000
    part = SmPartition(runtime, producer_sms={NARROW_SMS})
    with torch.cuda.stream(part.producer_stream):
        try:
            run(gemm, plan, q13, q2, variant=gemm.with_variant(claim="strided_experts"))
        except Exception as exc:
            print("launch failed:", type(exc).__name__)
            print("fault:", gemm.fault(), flush=True)
            os._exit(3)  # the trap took the context: no teardown
    print("no fault")
""")


def test_negative_control_the_strided_claim_needs_every_block_resident(runtime):
    one_child(runtime)
    done = run_trapping_child(NARROW_CHILD)
    assert done.returncode == 3, done.stdout + done.stderr
    # The block behind the missing L1 units gives up in its token loader's wait for them, or - the same stall one
    # step on, its math held by that wait - in its weight loader's wait for a stage the math never frees: the two
    # waits start microseconds apart, and which one's fault word is written last is a race.
    stalled = ("token loader: the expert's L1 units", "weight loader: a free stage")
    assert any(kind in done.stdout for kind in stalled), done.stdout + done.stderr
