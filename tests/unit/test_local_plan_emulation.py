"""A one-rank layer's batch-ready call plans its rows itself (docs/PROTOCOL.md, "One rank"): moe_local_route and
moe_local_scatter of device/kernels/moe_stream.cu, run on the CPU as written (tests/helpers/emulation/local_plan.py)
over the ring emulation's World, leave

* in the stage, the routing and weights a publish and a pull of the same batch leave there (pull_reference.py's
  reference, out-of-range experts masked and reported), -1 for the call's rows past a device count (a count out of
  range clamped and reported), the payload rows untouched, and nothing of the ring written: no slot, ready word,
  ack or cursor;
* the plan the documented layout asks for (plan_layout.check_layout): each local choice of the rows below the count
  once in its expert's group with its row's bytes, its scales (non-finite ones zeroed, each reported once) and its
  weight; every other row's source -1; own_row the row of each such choice and -1 for the call's other choices;

for FP8 and bf16 rows, grids of one and three blocks, and calls of every size up to the stage's. Two broken
variants of the emulation (no padding rows marked, scales reported at every copy) are caught."""

import pytest
import torch

from chunkring import PayloadFormat
from tests.helpers.emulation import local_plan
from tests.helpers.emulation.plan_layout import check_layout
from tests.helpers.emulation.world import E, N, World

CALLS = ((4, None), (3, None), (0, None), (4, 2), (4, 9), (2, -1), (1, None))  # at most a slot: T = 4


def check_plan(w: World, batch, count, plan) -> None:
    """The plan of the rows below ``count`` (all of them: None), against the layout and the batch."""
    stage = w.stages[0]
    n = batch.x.shape[0]
    rows = n if count is None else min(max(count, 0), n)
    idx = batch.idx[:rows].clone()
    idx[(idx < -1) | (idx >= E)] = -1
    choices = [sorted((0, t, k) for t in range(rows) for k in range(idx.shape[1]) if idx[t, k] == e)
               for e in range(stage.expert_lo, stage.expert_hi)]
    x = torch.zeros((1, N, batch.x.view(torch.uint8).shape[1]), dtype=torch.uint8)  # the stage's rows: [W, N, ...]
    x[0, :n] = batch.x.view(torch.uint8)
    sf = torch.zeros((1, N, 0 if batch.sf is None else batch.sf.shape[1]))
    if batch.sf is not None:
        sf[0, :n] = torch.nan_to_num(batch.sf, nan=0.0, posinf=0.0, neginf=0.0)
    weights = torch.zeros((1, N, batch.w.shape[1]))
    weights[0, :n] = batch.w
    real = check_layout(plan, choices, x, sf, weights)
    where = {(int(plan.token[p]), int(plan.k[p])): int(p) for p in real}
    got = plan.own_row[:rows * idx.shape[1]].tolist()
    assert got == [where.get((t, k), -1) for t in range(rows) for k in range(idx.shape[1])], "own_row"


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
@pytest.mark.parametrize("grid", [1, 3])
def test_a_one_rank_call_leaves_what_the_ring_and_the_plan_kernels_leave(monkeypatch, payload, grid):
    w = World(monkeypatch, 1, payload, grid=grid)
    for n, count in CALLS:
        batch = w.batch([n])
        plan = w.plan_local(batch, count)
        w.expected.check(w.masked)
        check_plan(w, batch, count, plan)
    assert {name for name, *_ in w.library.launches} == {"moe_local_route", "moe_local_scatter"}


def test_a_scatter_that_leaves_padding_rows_unmarked_is_caught(monkeypatch):
    real = local_plan.moe_local_scatter

    def unmarked(ring, a, part, parts, block, order_seed=0):
        a.plan_rows = 0  # no grid-stride share of rows to mark
        yield from real(ring, a, part, parts, block, order_seed)

    monkeypatch.setattr(local_plan, "moe_local_scatter", unmarked)
    w = World(monkeypatch, 1, PayloadFormat.FP8_E4M3)
    batch = w.batch([4])
    plan = w.plan_local(batch)
    with pytest.raises(AssertionError, match="src -1 on every other row"):
        check_plan(w, batch, None, plan)


def test_a_scatter_that_reports_a_scale_at_every_copy_is_caught(monkeypatch):
    def always(ring, src, slot, row, column, scale, report=True):
        return checked(ring, src, slot, row, column, scale)

    checked = local_plan.checked_scale
    monkeypatch.setattr(local_plan, "checked_scale", always)
    w = World(monkeypatch, 1, PayloadFormat.FP8_E4M3)
    batch = w.batch([4])
    batch.idx[0] = torch.tensor([1, 2])  # row 0 and its NaN scale to both local experts: copied twice
    w.plan_local(batch)
    with pytest.raises(AssertionError, match=r"tensor\(4\) == 3"):  # the reports counted: 2 experts, 1 scale
        w.expected.check(w.masked)
