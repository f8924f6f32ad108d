"""The host dispatch plan (one plan per call over every source's batch): plan_batch delivers exactly the
unmasked (source, token, k, expert) choices of the input, each once; groups are padded to block_m with
marked padding rows; rows sit in (source, row, k) order per expert, as a naive per-token planner puts them,
and a second run is bitwise identical; padded_rows_bound holds and is reached; bad input is refused with
the field named."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringUsageError
from chunkring.testing.plan import DispatchPlan, padded_rows_bound, plan_batch

MODES = ("uniform", "distinct", "one_expert", "few_experts", "all_masked")


def make_routes(ns, num_experts, topk, mode, seed):
    """Per-source int32 topk_idx and float32 topk_weights [n_s, K], all from one seed (every rank can
    rebuild every rank's inputs, so the oracle needs no communication)."""
    gen = torch.Generator().manual_seed(seed)
    target = int(torch.randint(num_experts, (1,), generator=gen))
    idx_list, w_list = [], []
    for n in ns:
        if mode == "uniform":  # duplicates within a row allowed; about 1 in (E + 1) masked
            idx = torch.randint(-1, num_experts, (n, topk), generator=gen)
        elif mode == "distinct":  # what a top-k router produces, then some choices masked
            idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :topk]
            idx[torch.rand(n, topk, generator=gen) < 0.2] = -1
        elif mode == "one_expert":  # every choice of every token to one expert
            idx = torch.full((n, topk), target)
        elif mode == "few_experts":  # most experts idle
            pool = torch.tensor([-1, target, (target * 7 + 3) % num_experts])
            idx = pool[torch.randint(len(pool), (n, topk), generator=gen)]
        else:
            idx = torch.full((n, topk), -1)
        idx_list.append(idx.to(torch.int32))
        w_list.append(torch.rand(n, topk, generator=gen, dtype=torch.float32) + 0.5)  # never 0, unlike padding
    return idx_list, w_list


@st.composite
def scenarios(draw):
    world = draw(st.integers(1, 8))
    experts_per_rank = draw(st.integers(1, 4))
    num_experts = world * experts_per_rank
    topk = draw(st.integers(1, min(8, num_experts)))
    ns = draw(st.lists(st.one_of(st.just(0), st.integers(0, 40)), min_size=world, max_size=world))
    return dict(world=world, experts_per_rank=experts_per_rank, num_experts=num_experts, topk=topk, ns=ns,
                tokens_per_slot=draw(st.integers(1, 16)), block_m=draw(st.sampled_from([1, 4, 16])),
                mode=draw(st.sampled_from(MODES)), seed=draw(st.integers(0, 2**31 - 1)))


def batch(sc, idx, w, dest):
    return plan_batch(idx, w, dest_rank=dest, world_size=sc["world"], num_experts=sc["num_experts"],
                      block_m=sc["block_m"])


def unmasked_choices(idx_list):
    return {(s, t, k, e) for s, idx in enumerate(idx_list) for t, row in enumerate(idx.tolist())
            for k, e in enumerate(row) if e != -1}


def naive_plan(idx_rows, w_rows, dest, experts_per_rank, block_m):
    """Per-token Python planner over every source's batch (idx_rows[s], w_rows[s]: lists of rows).
    Returns the plan's tensors as lists."""
    groups = [[] for _ in range(experts_per_rank)]
    for s, (rows_i, rows_w) in enumerate(zip(idx_rows, w_rows, strict=True)):
        for t, (experts, weights) in enumerate(zip(rows_i, rows_w, strict=True)):
            for k, (e, wt) in enumerate(zip(experts, weights, strict=True)):
                local = e - dest * experts_per_rank
                if e != -1 and 0 <= local < experts_per_rank:
                    groups[local].append((s, t, k, wt))
    offsets, rows = [0], []
    for group in groups:
        pad = -len(group) % block_m
        rows += group + [(-1, -1, -1, 0.0)] * pad
        offsets.append(len(rows))
    columns = list(zip(*rows, strict=True)) if rows else [()] * 4
    return dict(expert_offsets=offsets, counts=[len(g) for g in groups], src_rank=list(columns[0]),
                token_index=list(columns[1]), topk_pos=list(columns[2]), weight=list(columns[3]))


def assert_plan_equals(plan, expected):
    for name, values in expected.items():
        assert getattr(plan, name).tolist() == values, name


# -- properties ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_batch_delivers_every_unmasked_choice_once(sc):
    idx, w = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    entries = []
    for dest in range(sc["world"]):
        entries += batch(sc, idx, w, dest).entries()
    # Lists, not only sets: a choice delivered twice (two destinations, two rows) must fail too.
    assert sorted(entries) == sorted(unmasked_choices(idx))


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plan_rows_are_padded_groups_in_source_row_k_order(sc):
    idx, w = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    K, bm, epr = sc["topk"], sc["block_m"], sc["experts_per_rank"]
    # The layer sizes its buffers with the rows one source can send (max_tokens_per_rank >= every n_s).
    bound = padded_rows_bound(max(1, max(sc["ns"])), K, sc["world"], epr, bm)
    for dest in range(sc["world"]):
        plan = batch(sc, idx, w, dest)
        assert (plan.dest_rank, plan.experts_per_rank, plan.block_m) == (dest, epr, bm)
        sizes = plan.expert_offsets[1:] - plan.expert_offsets[:-1]
        assert int(plan.expert_offsets[0]) == 0 and bool((sizes >= 0).all())
        assert bool((sizes % bm == 0).all()) and bool((sizes >= plan.counts).all())
        assert bool((sizes - plan.counts < bm).all())  # no more padding than one block needs
        assert plan.num_padded_rows <= bound
        real = plan.src_rank >= 0
        assert int(real.sum()) == plan.num_real_rows
        # Real rows first in each group, padding after; padding carries -1 and weight 0 everywhere.
        in_group = torch.arange(plan.num_padded_rows) - plan.expert_offsets[:-1].repeat_interleave(sizes)
        assert torch.equal(real, in_group < plan.counts.repeat_interleave(sizes))
        for name in ("token_index", "topk_pos"):
            assert bool((getattr(plan, name)[~real] == -1).all()), name
        assert bool((plan.weight[~real] == 0).all())
        # Row indices lie in their source's batch, k in [0, K).
        ns = torch.tensor(sc["ns"], dtype=torch.int64)
        assert bool((plan.token_index[real] >= 0).all())
        assert bool((plan.token_index[real] < ns[plan.src_rank[real].long()]).all())
        assert bool((plan.topk_pos[real] >= 0).all()) and bool((plan.topk_pos[real] < K).all())
        # Within a group, rows are strictly increasing in (source, row, k).
        local = plan.local_expert_of_rows()[real].long()
        key = (plan.src_rank[real].long() * (max(sc["ns"]) + 1) + plan.token_index[real]) * K \
            + plan.topk_pos[real].long()
        same_group = local[1:] == local[:-1]
        assert bool((key[1:][same_group] > key[:-1][same_group]).all())
        # Each real row names the expert of its group and carries the input's weight.
        for s in plan.src_rank[real].unique().tolist():
            mine = plan.src_rank[real] == s
            t, k = plan.token_index[real][mine], plan.topk_pos[real][mine].long()
            assert torch.equal(idx[s][t, k].long(), local[mine] + dest * epr)
            assert torch.equal(w[s][t, k], plan.weight[real][mine])


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plans_match_a_naive_per_token_planner_bitwise(sc):
    idx, w = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    idx_rows, w_rows = [i.tolist() for i in idx], [x.tolist() for x in w]
    for dest in range(sc["world"]):
        expected = naive_plan(idx_rows, w_rows, dest, sc["experts_per_rank"], sc["block_m"])
        assert_plan_equals(batch(sc, idx, w, dest), expected)
        assert_plan_equals(batch(sc, idx, w, dest), expected)  # deterministic: a second run is identical


# -- edge cases ------------------------------------------------------------------------------------------


def routes(*rows, topk=None):
    """int32/float32 [n, K] from Python rows; weights 1 + position so they are distinguishable."""
    k = topk if topk is not None else len(rows[0])
    idx = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), k)
    return idx, torch.arange(idx.numel(), dtype=torch.float32).reshape(idx.shape) + 1


def test_all_sources_empty():
    idx = [torch.zeros(0, 2, dtype=torch.int32)] * 3
    w = [torch.zeros(0, 2)] * 3
    for dest in range(3):
        plan = plan_batch(idx, w, dest_rank=dest, world_size=3, num_experts=6, block_m=16)
        assert plan.num_real_rows == plan.num_padded_rows == 0
        assert plan.expert_offsets.tolist() == [0, 0, 0] and plan.entries() == []


def test_all_masked_gives_empty_groups():
    idx, w = routes([-1, -1], [-1, -1], [-1, -1])
    for dest in range(2):
        plan = plan_batch([idx, idx], [w, w], dest_rank=dest, world_size=2, num_experts=4, block_m=4)
        assert plan.num_padded_rows == 0 and plan.counts.tolist() == [0, 0]


def test_topk_one_exact_layout():
    # Source 0: tokens -> experts 3, 2, -1, 3; source 1: tokens -> 2, 3. Rank 1 owns experts 2 and 3.
    i0, w0 = routes([3], [2], [-1], [3])
    i1, w1 = routes([2], [3])
    kw = dict(world_size=2, num_experts=4, block_m=4)
    assert plan_batch([i0, i1], [w0, w1], dest_rank=0, **kw).num_padded_rows == 0
    plan = plan_batch([i0, i1], [w0, w1], dest_rank=1, **kw)
    # Expert 2: (s0 t1), (s1 t0); expert 3: (s0 t0), (s0 t3), (s1 t1); the masked token 2 nowhere.
    assert plan.expert_offsets.tolist() == [0, 4, 8] and plan.counts.tolist() == [2, 3]
    assert plan.src_rank.tolist() == [0, 1, -1, -1, 0, 0, 1, -1]
    assert plan.token_index.tolist() == [1, 0, -1, -1, 0, 3, 1, -1]
    assert plan.topk_pos.tolist() == [0, 0, -1, -1, 0, 0, 0, -1]
    assert plan.weight.tolist() == [2.0, 1.0, 0, 0, 1.0, 4.0, 2.0, 0]
    assert plan.local_expert_of_rows().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.entries() == [(0, 0, 0, 3), (0, 1, 0, 2), (0, 3, 0, 3), (1, 0, 0, 2), (1, 1, 0, 3)]


def test_one_expert_everything_k_order_within_a_token():
    idx, w = routes([1, 1, 1], [1, 1, 1])  # both tokens name expert 1 three times
    plan = plan_batch([idx], [w], dest_rank=0, world_size=1, num_experts=2, block_m=4)
    assert plan.counts.tolist() == [0, 6] and plan.expert_offsets.tolist() == [0, 0, 8]
    assert plan.token_index.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    assert plan.topk_pos.tolist() == [0, 1, 2, 0, 1, 2, -1, -1]


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("experts_per_rank", [1, 3, 40])
def test_padded_rows_bound_is_reached(block_m, experts_per_rank):
    # Every source's full batch: experts 0..g-2 get one row each, expert g-1 every other row.
    world, C, K = 3, 4, 2
    bound = padded_rows_bound(C, K, world, experts_per_rank, block_m)
    real = world * C * K
    groups = min(experts_per_rank, real)
    flat = torch.full((real,), groups - 1, dtype=torch.int32)
    flat[:groups - 1] = torch.arange(groups - 1, dtype=torch.int32)
    idx = list(flat.reshape(world, C, K))
    w = [torch.ones(C, K)] * world
    plan = plan_batch(idx, w, dest_rank=0, world_size=world, num_experts=world * experts_per_rank, block_m=block_m)
    assert plan.num_real_rows == real and plan.num_padded_rows == bound


def test_plan_repr_and_no_tensor_eq():
    idx, w = routes([0])
    plan = plan_batch([idx], [w], dest_rank=0, world_size=1, num_experts=1, block_m=4)
    assert "real_rows=1" in repr(plan) and "padded_rows=4" in repr(plan)
    assert plan != plan_batch([idx], [w], dest_rank=0, world_size=1, num_experts=1, block_m=4)  # identity eq


# -- validation: refused before any work, field named ------------------------------------------------------

GOOD_IDX, GOOD_W = routes([0, 1], [2, -1])
KW = dict(dest_rank=0, world_size=2, num_experts=4, block_m=4)
I32, I64 = torch.int32, torch.int64


def batch_with(idx=None, w=None, **changes):
    idx = [GOOD_IDX, GOOD_IDX] if idx is None else idx
    w = [GOOD_W, GOOD_W] if w is None else w
    return plan_batch(idx, w, **{**KW, **changes})


def plan_of(expert_offsets=None, counts=None, src_rank=None, token_index=None, topk_pos=None, weight=None):
    """A DispatchPlan of one local expert and one row, each field replaceable."""
    return DispatchPlan(
        torch.tensor([0, 1]) if expert_offsets is None else expert_offsets,
        torch.tensor([1]) if counts is None else counts,
        torch.zeros(1, dtype=I32) if src_rank is None else src_rank,
        torch.zeros(1, dtype=I64) if token_index is None else token_index,
        torch.zeros(1, dtype=I32) if topk_pos is None else topk_pos,
        torch.ones(1) if weight is None else weight,
        dest_rank=0, experts_per_rank=1, block_m=1)


def test_plan_of_is_a_valid_plan():
    assert plan_of().entries() == [(0, 0, 0, 0)]


@pytest.mark.parametrize("call,field", [
    (lambda: batch_with([GOOD_IDX.long(), GOOD_IDX]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX.float(), GOOD_IDX]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX, GOOD_IDX.tolist()]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX, GOOD_IDX[0]], [GOOD_W, GOOD_W[0]]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX, GOOD_IDX[:, :0]], [GOOD_W, GOOD_W[:, :0]]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX, GOOD_IDX[:, :1]], [GOOD_W, GOOD_W[:, :1]]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX, GOOD_IDX.to("meta")]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX]), "per_source_topk_idx"),
    (lambda: batch_with([GOOD_IDX, GOOD_IDX + 2]), "per_source_topk_idx"),  # 4 == num_experts
    (lambda: batch_with([GOOD_IDX, GOOD_IDX - 2]), "per_source_topk_idx"),  # -3
    (lambda: batch_with(w=[GOOD_W, GOOD_W.double()]), "per_source_topk_weights"),
    (lambda: batch_with(w=[GOOD_W, GOOD_W.half()]), "per_source_topk_weights"),
    (lambda: batch_with(w=[GOOD_W, GOOD_W[:1]]), "per_source_topk_weights"),
    (lambda: batch_with(w=[GOOD_W, GOOD_W.T.contiguous()[:1]]), "per_source_topk_weights"),
    (lambda: batch_with(w=[GOOD_W, GOOD_W.to("meta")]), "per_source_topk_weights"),
    (lambda: batch_with(w=[GOOD_W, None]), "per_source_topk_weights"),
    (lambda: batch_with(w=(GOOD_W,)), "per_source_topk_weights"),
    (lambda: batch_with(w=GOOD_W), "per_source_topk_weights"),
    (lambda: batch_with(world_size=0), "world_size"),
    (lambda: batch_with(world_size=True), "world_size"),
    (lambda: batch_with(num_experts=5), "num_experts"),
    (lambda: batch_with(num_experts=0), "num_experts"),
    (lambda: batch_with(block_m=0), "block_m"),
    (lambda: batch_with(block_m=-1), "block_m"),
    (lambda: batch_with(block_m=4.0), "block_m"),
    (lambda: batch_with(dest_rank=2), "dest_rank"),
    (lambda: batch_with(dest_rank=-1), "dest_rank"),
    (lambda: padded_rows_bound(0, 1, 1, 1, 1), "rows_per_source"),
    (lambda: padded_rows_bound(1, 0, 1, 1, 1), "topk"),
    (lambda: padded_rows_bound(1, 1, 0, 1, 1), "world_size"),
    (lambda: padded_rows_bound(1, 1, 1, 0, 1), "experts_per_rank"),
    (lambda: padded_rows_bound(1, 1, 1, 1, 0), "block_m"),
    (lambda: plan_of(expert_offsets=torch.tensor([0, 1], dtype=I32)), "expert_offsets"),
    (lambda: plan_of(counts=torch.tensor([1, 0])), "counts"),
    (lambda: plan_of(src_rank=torch.zeros(2, dtype=I32)), "src_rank"),
    (lambda: plan_of(token_index=torch.zeros(1, dtype=I32)), "token_index"),
    (lambda: plan_of(topk_pos=torch.zeros(1, dtype=I64)), "topk_pos"),
    (lambda: plan_of(weight=torch.ones(1, dtype=torch.float64)), "weight"),
])
def test_bad_input_is_refused_with_the_field_named(call, field):
    with pytest.raises(ChunkringUsageError) as info:
        call()
    assert info.value.field == field, str(info.value)
