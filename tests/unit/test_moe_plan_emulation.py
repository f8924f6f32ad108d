"""The batch plan's kernels (moe_plan_count, moe_plan_scatter of device/kernels/moe_experts.cu) run whole on the CPU as
written (tests/helpers/emulation/plan.py: every block and warp of the launch grid, warps reaching their atomics in a
shuffled order, the stage read through its StageDesc words - field order from layout/moe_desc.cuh, version and size
checked, each address resolved where it is dereferenced), launched by the host's own ExpertCompute.plan on a real
Stage (Stage.allocate) filled as moe_pull leaves it: each source's routing (global expert ids, -1 masked) and weights
at its token index for the rows it sent, payload and scales only of the rows naming a local expert (the other rows'
bytes are stale: reading one is an error), -1 routing past the rows sent. The host's allocations keep their meaning:
torch.empty memory is unreadable until stored, torch.zeros / torch.full memory holds its values.

What it pins, against a Python reference of the layout DevicePlan's docstring promises: counts per local expert,
each group at the padded prefix sum (GROUP_ALIGN = 128 rows a group), group_end = offset + count (psum form), each
(source, token, k) choice of a local expert in its group exactly once with its payload bytes, its scales MN-major
(rows_sf[j * P + p]), source, token, k and weight; src -1 on every other row (the host's prefill) and nothing else
written - no padding row, no stage byte; the cursors end at the counts. FP8 and bf16 payloads, 1-3 sources sending
fewer rows than N, experts with no rows, groups of more than 128 rows, other ranks' experts, expert_lo > 0, and more
choices than the grid's threads (the grid-stride loops). Then the chain stage -> plan -> the decode kernels ->
combine push (tests/helpers/emulation/decode.py), against a float64 reference of the whole layer at this rank.

What only a GPU shows: the hardware's atomics and warp votes, memory ordering between the pull and the plan, speed
(tests/gpu/test_moe_experts.py and the layer's GPU tests)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from chunkring import MoEConfig, PayloadFormat
from chunkring.moe._engine.experts import OwnRows
from chunkring.moe._engine.stage import Stage
from tests.helpers.emulation import decode as decode_emu
from tests.helpers.emulation import plan as plan_emu
from tests.helpers.emulation.library import EmulatedLibrary
from tests.helpers.emulation.machine import EmptyTracker, EmulatedMemoryError, Memory
from tests.helpers.emulation.plan_layout import (
    check_layout,
    check_written,
    combine_buffers,
    expert_compute,
    layer_rows,
    layer_weights,
    quantise_rows,
    relative_errors,
    written_slots,
)


@dataclass(frozen=True)
class Case:
    payload: PayloadFormat
    sources: int  # W
    experts: int  # E_local
    rank: int  # this rank: experts [rank * E, (rank + 1) * E)
    topk: int
    tokens: int  # N
    sent: tuple[int, ...]  # rows each source brought (<= N)
    counts: tuple[int, ...]  # choices per local expert
    hidden: int = 256

    def __str__(self) -> str:
        return (f"{self.payload.name}-W{self.sources}-E{self.experts}-rank{self.rank}-K{self.topk}-N{self.tokens}"
                f"-sent{self.sent}-rows{self.counts}")


FP8, BF16 = PayloadFormat.FP8_E4M3, PayloadFormat.BF16
CASES = [
    Case(FP8, 3, 3, 1, 2, 24, (24, 10, 17), (9, 0, 30)),  # expert_lo 3; an idle expert; other ranks' experts
    Case(FP8, 1, 2, 0, 1, 8, (8,), (0, 0)),  # nothing local: every choice masked
    Case(FP8, 2, 2, 0, 2, 80, (80, 71), (150, 1)),  # a group of 150 rows (two 128-row blocks), one of 1
    Case(BF16, 2, 3, 1, 2, 20, (20, 5), (7, 13, 0)),  # bf16 rows (2H bytes), no scales
    Case(BF16, 4, 2, 3, 2, 300, (300, 300, 120, 0), (40, 0)),  # 2400 choices: past the 2048 threads; one sent nothing
    Case(FP8, 3, 1, 2, 3, 300, (300, 250, 280), (60,)),  # 2700 choices: past the grid's 2048 threads
    # Rows past warp_copy16's 8 x 32 units in flight (4352 bytes), 34 scales a row (past a warp's 32 lanes).
    Case(FP8, 2, 2, 1, 1, 6, (6, 3), (4, 3), hidden=4352),
    Case(BF16, 1, 2, 0, 2, 4, (3,), (5, 1), hidden=2304),
]


def routing(case: Case, gen: torch.Generator) -> torch.Tensor:
    """idx [W, N, K] as moe_pull stores it: global expert ids of the rows sent, local expert e exactly counts[e]
    times; of the other choices some masked (-1), the rest other ranks' experts; -1 past the rows sent."""
    W, N, K, E = case.sources, case.tokens, case.topk, case.experts
    sent = torch.zeros(W, N, dtype=torch.bool)
    for s, n in enumerate(case.sent):
        sent[s, :n] = True
    slots = torch.nonzero(sent.repeat_interleave(K, 1).view(-1)).flatten()
    slots = slots[torch.randperm(len(slots), generator=gen)]
    idx = torch.full((W * N * K,), -1, dtype=torch.int32)
    at = 0
    for e, n in enumerate(case.counts):
        idx[slots[at:at + n]] = case.rank * E + e
        at += n
    others = [g for g in range(E * W) if not case.rank * E <= g < (case.rank + 1) * E]
    if others:
        rest = slots[at:][::2]
        idx[rest] = torch.tensor(others, dtype=torch.int32)[torch.randint(len(others), (len(rest),), generator=gen)]
    return idx.view(W, N, K)


def pulled_stage(case: Case, config: MoEConfig, gen: torch.Generator):
    """Stage.allocate, then what moe_pull writes: idx and w of every row sent, x and sf of the rows with a local
    choice. Returns the stage and those rows' mask [W, N]."""
    W, N, H, E = case.sources, case.tokens, case.hidden, case.experts
    stage = Stage.allocate(config, W, torch.device("cpu"), expert_lo=case.rank * E, expert_hi=(case.rank + 1) * E)
    stage.idx.copy_(routing(case, gen))
    stage.w.copy_(torch.rand(W, N, case.topk, generator=gen) + 0.5)
    fetched = ((stage.idx >= stage.expert_lo) & (stage.idx < stage.expert_hi)).any(-1)
    x = torch.randn(W, N, H, generator=gen) * 2.0 ** torch.randint(-4, 5, (W, N, 1), generator=gen)
    if case.payload.has_scales:
        x_fp8, sf = quantise_rows(x)
        stage.x[fetched], stage.sf[fetched] = x_fp8[fetched], sf[fetched]
    else:
        stage.x[fetched] = x[fetched].to(torch.bfloat16)
    stage.x.view(torch.uint8)[~fetched] = 0xEE  # stale bytes (also unreadable in the emulated memory)
    return stage, fetched


def register_stage(memory: Memory, stage: Stage, fetched: torch.Tensor) -> None:
    """The stage as the device holds it after the pull: rows not fetched hold nothing the plan may read."""
    for name in ("desc", "idx", "w", "held"):
        memory.add(getattr(stage, name), f"stage {name}")
    W, N = fetched.shape
    for name in ("x", "sf"):
        t = getattr(stage, name)
        if t.numel():  # bf16: no scales, an empty tensor nothing points into
            memory.add(t, f"stage {name}", initialised=False).valid.reshape(W, N, -1)[fetched.numpy()] = True


def config_of(case: Case, inter: int = 128) -> MoEConfig:
    return MoEConfig(num_experts=case.experts * case.sources, hidden=case.hidden, intermediate=inter, topk=case.topk,
                     max_tokens_per_rank=case.tokens, payload=case.payload)


def run(case: Case, monkeypatch, *, seed: int = 0, corrupt=None, extra_kernels=None):
    gen = torch.Generator().manual_seed(seed)
    config = config_of(case)
    stage, fetched = pulled_stage(case, config, gen)
    if corrupt is not None:
        corrupt(stage)
    before = {name: getattr(stage, name).clone() for name in ("desc", "x", "sf", "idx", "w", "held")}
    memory = Memory()
    register_stage(memory, stage, fetched)
    library = EmulatedLibrary(memory, {**plan_emu.kernels(order_seed=seed), **(extra_kernels or {})},
                              initialised=EmptyTracker(monkeypatch).initialised)
    compute = expert_compute(config, case.sources, case.rank, case.experts, library, monkeypatch)
    plan = compute.plan(stage)
    return types.SimpleNamespace(case=case, config=config, stage=stage, before=before, memory=memory, library=library,
                                 compute=compute, plan=plan)


def local_choices(r) -> list[list[tuple[int, int, int]]]:
    """Per local expert, its (source, token, k) choices in the stage, sorted."""
    idx = r.before["idx"]
    out = [[] for _ in range(r.case.experts)]
    for s, t, k in torch.nonzero((idx >= r.stage.expert_lo) & (idx < r.stage.expert_hi)).tolist():
        out[int(idx[s, t, k]) - r.stage.expert_lo].append((s, t, k))
    return out


def check_plan(r) -> np.ndarray:
    """The plan against the layout DevicePlan promises for the stage's choices; returns the real rows."""
    return check_layout(r.plan, local_choices(r), r.before["x"], r.before["sf"], r.before["w"], r.case.rank)


def check_nothing_else_written(r, real: np.ndarray) -> None:
    """Only the real rows' bytes of the plan, the counters - and no stage byte - were written."""
    check_written(r.memory, r.plan, real, r.memory.find(r.plan.src).stores)  # the scatter's: the last launch
    for name, t in r.before.items():
        assert torch.equal(getattr(r.stage, name), t), f"the plan kernels write no stage byte ({name})"
    cursors = next(args for name, _, _, args in r.library.launches if name == "moe_plan_scatter")["args"]["cursors"]
    assert cursors.tolist() == r.plan.counts.tolist(), "every cursor ends at its count"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_plan_kernels_build_the_documented_layout(case, monkeypatch):
    r = run(case, monkeypatch)
    grid, P = r.compute.push_blocks, r.compute.capacity
    assert [(name, g, b) for name, g, b, _ in r.library.launches] == [
        ("moe_plan_reset", max(1, min(grid, -(-P // 256))), 256), ("moe_plan_count", grid, 256),
        ("moe_plan_scatter", grid, 256)]
    check_nothing_else_written(r, check_plan(r))


def test_rows_land_anywhere_in_their_group(monkeypatch):
    """Another order of the warps' atomics places rows elsewhere; the layout's promises hold all the same."""
    placements = set()
    for seed in range(3):
        r = run(CASES[0], monkeypatch, seed=seed)
        real = check_plan(r)
        check_nothing_else_written(r, real)
        placements.add(tuple(r.plan.token.numpy()[real].tolist()))
    assert len(placements) > 1


def test_the_kernels_read_the_stage_through_its_descriptor(monkeypatch):
    """Not vacuous: the descriptor's words decide. An expert_hi one lower in the words (the Stage's own field
    unchanged, so the host's check passes) plans the last expert's 30 choices nowhere; another layout version
    traps."""
    def lower(stage):
        stage.desc[plan_emu.STRUCTS["StageDesc"].index("expert_hi")] -= 1

    r = run(CASES[0], monkeypatch, corrupt=lower)
    assert r.plan.counts.tolist() == [9, 0, 0]
    with pytest.raises(AssertionError):
        check_plan(r)

    def version(stage):
        stage.desc[0] += 1

    with pytest.raises(plan_emu.EmulatedTrap, match="require_descriptor"):
        run(CASES[0], monkeypatch, corrupt=version)


def test_a_row_the_pull_did_not_fetch_is_never_read(monkeypatch):
    """Not vacuous: route a choice of a row the pull skipped (no local expert: its bytes are stale) to a local
    expert after the pull, and the scatter's copy of it reads bytes nothing wrote."""
    def reroute(stage):
        local = (stage.idx >= stage.expert_lo) & (stage.idx < stage.expert_hi)
        s, t, k = torch.nonzero((stage.idx >= 0) & ~local.any(-1, keepdim=True))[0]
        stage.idx[s, t, k] = stage.expert_lo

    with pytest.raises(EmulatedMemoryError, match="uninitialised bytes of stage x"):
        run(CASES[0], monkeypatch, corrupt=reroute)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=str)
def test_stage_to_combine_matches_the_layer(case, monkeypatch):
    """stage -> ExpertCompute.plan -> ExpertCompute.experts (the decode kernels) -> combine_push, every kernel
    emulated, against the float64 layer: each (source, token, k) of a local expert in its combine slot within
    the bf16 roundings of out and the combine (where fp32 and exact sums round gate/up differently, rarely, an act
    element moves by an e4m3 unit), and no other slot written."""
    r = run(case, monkeypatch, extra_kernels=decode_emu.kernels([]))
    w13, w2 = layer_weights(r.memory, case.experts, case.hidden, r.config.intermediate)
    combine, peer_combine = combine_buffers(r.memory, case.sources, case.tokens * case.topk, case.hidden)
    out = r.compute.experts(r.plan, w13, w2)
    r.compute.combine_push(r.plan, out, peer_combine)
    assert [name for name, *_ in r.library.launches] == ["moe_plan_reset", "moe_plan_count", "moe_plan_scatter",
                                                         "moe_decode_l1", "moe_decode_l2", "moe_combine_push"]
    want = layer_rows(local_choices(r), r.before["x"], r.before["sf"], r.before["w"], w13, w2)
    assert written_slots(combine) == set(want), "exactly the local choices' combine slots"
    # Two bf16 roundings (out, the combine) of up to 2^-9 each, and a rare e4m3 flip: measured at most 2^-8.5.
    assert max(relative_errors(combine, want), default=0.0) < 2.0**-7, "each combine row within 2^-7, relative"


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=str)
def test_own_choices_stay_in_place_and_reach_the_reduction(case, monkeypatch):
    """The batch plan's push leaves this rank's own choices where L2 wrote them (``keep_own``), and the rank's
    reduction reads them there through own_row, weighted as the push weights: its output equals, bit for bit, the
    reduction of a combine buffer into which every row was pushed. The rows of this rank's tokens that other ranks'
    experts compute come from the test, as those ranks' pushes would."""
    r = run(case, monkeypatch, extra_kernels=decode_emu.kernels([]))
    w13, w2 = layer_weights(r.memory, case.experts, case.hidden, r.config.intermediate)
    combine, peer_combine = combine_buffers(r.memory, case.sources, case.tokens * case.topk, case.hidden)
    out = r.compute.experts(r.plan, w13, w2)
    r.compute.combine_push(r.plan, out, peer_combine, keep_own=True)
    rank, K, H = case.rank, case.topk, case.hidden
    want = layer_rows(local_choices(r), r.before["x"], r.before["sf"], r.before["w"], w13, w2)
    assert written_slots(combine) == {slot for slot in want if slot[0] != rank}, "every local choice but the own"
    idx = r.before["idx"][rank]
    peers = torch.nonzero((idx >= 0) & ((idx < r.stage.expert_lo) | (idx >= r.stage.expert_hi))).tolist()
    gen = torch.Generator().manual_seed(5)
    for t, k in peers:
        combine[rank][t * K + k] = torch.randn(H, generator=gen).bfloat16()
    pushed = combine[rank].clone()  # the same buffer had the push copied the own rows too
    for p in np.flatnonzero((r.plan.src == rank).numpy()):
        pushed[int(r.plan.token[p]) * K + int(r.plan.k[p])] = (out[p].float() * r.plan.weight[p]).bfloat16()
    want_out = torch.zeros(case.tokens, H)
    for k in range(K):  # fp32, in k order, the routed choices only
        routed = (idx[:, k] >= 0).unsqueeze(1)
        want_out = torch.where(routed, want_out + pushed[k::K].float(), want_out)
    result = torch.empty((case.tokens, H), dtype=torch.bfloat16)
    r.compute.reduce(combine[rank], r.stage.idx[rank], r.stage.w[rank], result, OwnRows(r.plan.own_row, out))
    assert r.library.launches[-1][0] == "moe_combine_reduce"
    assert torch.equal(result, want_out.bfloat16()), "the own rows read in place, weighted as the push weights"
