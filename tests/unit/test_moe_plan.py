"""Dispatch plans (chunk-local expert pools): streamed and batch-ready plans deliver exactly the unmasked
(source, token, k, expert) choices of the input, each once; groups are padded to block_m with marked
padding rows; rows sit in (source, row, k) order per expert, as a naive per-token planner puts them;
chunk steps and row indices follow tokens_per_slot; padded_rows_bound holds and is reached; bad input
is refused with the field named."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringUsageError
from chunkring.moe_plan import (
    ChunkRoute,
    DispatchPlan,
    padded_rows_bound,
    plan_batch,
    plan_chunk_step,
    plan_streamed,
    split_into_chunks,
)

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


def streamed(sc, idx, w, dest):
    return plan_streamed(idx, w, tokens_per_slot=sc["tokens_per_slot"], dest_rank=dest, world_size=sc["world"],
                         num_experts=sc["num_experts"], block_m=sc["block_m"])


def batch(sc, idx, w, dest):
    return plan_batch(idx, w, dest_rank=dest, world_size=sc["world"], num_experts=sc["num_experts"],
                      block_m=sc["block_m"])


def unmasked_choices(idx_list):
    return {(s, t, k, e) for s, idx in enumerate(idx_list) for t, row in enumerate(idx.tolist())
            for k, e in enumerate(row) if e != -1}


def naive_plan(chunk_rows, dest, experts_per_rank, block_m):
    """Per-token Python planner: chunk_rows[s] is None or (chunk_index, token_base, idx rows, weight rows).
    Returns the plan's tensors as lists."""
    groups = [[] for _ in range(experts_per_rank)]
    for s, chunk in enumerate(chunk_rows):
        if chunk is None:
            continue
        chunk_index, base, idx_rows, w_rows = chunk
        for r, (experts, weights) in enumerate(zip(idx_rows, w_rows)):
            for k, (e, wt) in enumerate(zip(experts, weights)):
                local = e - dest * experts_per_rank
                if e != -1 and 0 <= local < experts_per_rank:
                    groups[local].append((s, chunk_index, r, k, wt, base + r))
    offsets, rows = [0], []
    for group in groups:
        pad = -len(group) % block_m
        rows += group + [(-1, -1, -1, -1, 0.0, -1)] * pad
        offsets.append(len(rows))
    columns = list(zip(*rows)) if rows else [()] * 6
    return dict(expert_offsets=offsets, counts=[len(g) for g in groups], src_rank=list(columns[0]),
                src_chunk=list(columns[1]), src_row=list(columns[2]), topk_pos=list(columns[3]),
                weight=list(columns[4]), token_index=list(columns[5]))


def assert_plan_equals(plan, expected):
    for name, values in expected.items():
        assert getattr(plan, name).tolist() == values, name


# -- properties ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_streamed_and_batch_deliver_every_unmasked_choice_once(sc):
    idx, w = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    truth = unmasked_choices(idx)
    expected_steps = max(max(1, math.ceil(n / sc["tokens_per_slot"])) for n in sc["ns"])
    streamed_entries, batch_entries = [], []
    for dest in range(sc["world"]):
        plans = streamed(sc, idx, w, dest)
        assert len(plans) == expected_steps
        for plan in plans:
            streamed_entries += plan.entries()
        batch_entries += batch(sc, idx, w, dest).entries()
    # Lists, not only sets: a choice delivered twice (two steps, two destinations) must fail too.
    assert sorted(streamed_entries) == sorted(batch_entries) == sorted(truth)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plan_rows_are_padded_groups_consistent_with_chunks(sc):
    idx, w = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    C, bm, epr = sc["tokens_per_slot"], sc["block_m"], sc["experts_per_rank"]
    bound = padded_rows_bound(C, sc["topk"], sc["world"], epr, bm)
    for dest in range(sc["world"]):
        for step, plan in enumerate(streamed(sc, idx, w, dest)):
            sizes = plan.expert_offsets[1:] - plan.expert_offsets[:-1]
            assert int(plan.expert_offsets[0]) == 0 and bool((sizes >= 0).all())
            assert bool((sizes % bm == 0).all()) and bool((sizes >= plan.counts).all())
            assert bool((sizes - plan.counts < bm).all())  # no more padding than one block needs
            assert plan.num_padded_rows <= bound
            real = plan.src_rank >= 0
            assert int(real.sum()) == plan.num_real_rows
            # Real rows first in each group, padding after; padding carries -1 and weight 0 everywhere.
            first_pad = plan.expert_offsets[:-1] + plan.counts
            in_group = torch.arange(plan.num_padded_rows) - plan.expert_offsets[:-1].repeat_interleave(sizes)
            assert torch.equal(real, in_group < plan.counts.repeat_interleave(sizes))
            assert bool((first_pad <= plan.expert_offsets[1:]).all())
            for name in ("src_chunk", "src_row", "topk_pos", "token_index"):
                assert bool((getattr(plan, name)[~real] == -1).all()), name
            assert bool((plan.weight[~real] == 0).all())
            # Rows come from chunk `step` of their source, at tokens_per_slot granularity.
            assert bool((plan.src_chunk[real] == step).all())
            assert bool((plan.src_row[real] < C).all()) and bool((plan.src_row[real] >= 0).all())
            assert torch.equal(plan.token_index[real], plan.src_chunk[real].long() * C + plan.src_row[real].long())
            # Each real row names the expert of its group and carries the input's weight.
            local = plan.local_expert_of_rows()[real].long()
            for s in plan.src_rank[real].unique().tolist():
                mine = plan.src_rank[real] == s
                t, k = plan.token_index[real][mine], plan.topk_pos[real][mine].long()
                assert torch.equal(idx[s][t, k].long(), local[mine] + dest * epr)
                assert torch.equal(w[s][t, k], plan.weight[real][mine])


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plans_match_a_naive_per_token_planner_bitwise(sc):
    idx, w = make_routes(sc["ns"], sc["num_experts"], sc["topk"], sc["mode"], sc["seed"])
    C = sc["tokens_per_slot"]
    rows = [(i.tolist(), x.tolist()) for i, x in zip(idx, w)]
    steps = max(max(1, math.ceil(n / C)) for n in sc["ns"])
    for dest in range(sc["world"]):
        plans = streamed(sc, idx, w, dest)
        again = streamed(sc, idx, w, dest)  # deterministic: a second run is identical
        for j, (plan, plan2) in enumerate(zip(plans, again)):
            chunk_rows = [(j, j * C, i[j * C:(j + 1) * C], x[j * C:(j + 1) * C]) if j == 0 or j * C < len(i)
                          else None for i, x in rows]
            expected = naive_plan(chunk_rows, dest, sc["experts_per_rank"], sc["block_m"])
            assert_plan_equals(plan, expected)
            assert_plan_equals(plan2, expected)
        assert len(plans) == steps
        assert_plan_equals(batch(sc, idx, w, dest),
                           naive_plan([(0, 0, i, x) for i, x in rows], dest, sc["experts_per_rank"], sc["block_m"]))


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
        plans = plan_streamed(idx, w, tokens_per_slot=4, dest_rank=dest, world_size=3, num_experts=6, block_m=16)
        assert len(plans) == 1  # every stream still publishes its one (empty) chunk
        for plan in plans + [plan_batch(idx, w, dest_rank=dest, world_size=3, num_experts=6, block_m=16)]:
            assert plan.num_real_rows == plan.num_padded_rows == 0
            assert plan.expert_offsets.tolist() == [0, 0, 0] and plan.entries() == []


def test_all_masked_gives_empty_groups():
    idx, w = routes([-1, -1], [-1, -1], [-1, -1])
    plans = plan_streamed([idx, idx], [w, w], tokens_per_slot=2, dest_rank=1, world_size=2, num_experts=4,
                          block_m=4)
    assert len(plans) == 2 and all(p.num_padded_rows == 0 for p in plans)


def test_topk_one_exact_layout():
    # Source 0: tokens -> experts 3, 2, -1, 3; source 1: tokens -> 2, 3. Rank 1 owns experts 2 and 3.
    i0, w0 = routes([3], [2], [-1], [3])
    i1, w1 = routes([2], [3])
    plans = plan_streamed([i0, i1], [w0, w1], tokens_per_slot=2, dest_rank=1, world_size=2, num_experts=4,
                          block_m=4)
    assert len(plans) == 2
    step0, step1 = plans
    # Step 0: chunk 0 of both sources. Expert 2: (s0 row1), (s1 row0); expert 3: (s0 row0), (s1 row1).
    assert step0.expert_offsets.tolist() == [0, 4, 8] and step0.counts.tolist() == [2, 2]
    assert step0.src_rank.tolist() == [0, 1, -1, -1, 0, 1, -1, -1]
    assert step0.src_row.tolist() == [1, 0, -1, -1, 0, 1, -1, -1]
    assert step0.weight.tolist() == [2.0, 1.0, 0, 0, 1.0, 2.0, 0, 0]
    # Step 1: only source 0 still streams (chunk 1: tokens 2, 3); token 2 is masked.
    assert step1.counts.tolist() == [0, 1] and step1.expert_offsets.tolist() == [0, 0, 4]
    assert step1.src_chunk.tolist()[:1] == [1] and step1.token_index.tolist() == [3, -1, -1, -1]
    assert step1.entries() == [(0, 3, 0, 3)]


def test_one_expert_everything_k_order_within_a_token():
    idx, w = routes([1, 1, 1], [1, 1, 1])  # both tokens name expert 1 three times
    plan = plan_batch([idx], [w], dest_rank=0, world_size=1, num_experts=2, block_m=4)
    assert plan.counts.tolist() == [0, 6] and plan.expert_offsets.tolist() == [0, 0, 8]
    assert plan.src_row.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    assert plan.topk_pos.tolist() == [0, 1, 2, 0, 1, 2, -1, -1]


def test_plan_chunk_step_matches_streamed_and_skips_ended_sources():
    i0, w0 = routes([0, 1], [1, 0], [1, 1])
    i1, w1 = routes([0, 0])
    c0, c1 = split_into_chunks(i0, w0, 2), split_into_chunks(i1, w1, 2)
    streamed_plans = plan_streamed([i0, i1], [w0, w1], tokens_per_slot=2, dest_rank=0, world_size=2,
                                   num_experts=4, block_m=1)
    kw = dict(dest_rank=0, world_size=2, num_experts=4, block_m=1)
    for j, chunks in enumerate([[c0[0], c1[0]], [c0[1], None]]):
        plan = plan_chunk_step(chunks, **kw)
        for name in ("expert_offsets", "src_rank", "src_chunk", "src_row", "topk_pos", "weight", "token_index"):
            assert torch.equal(getattr(plan, name), getattr(streamed_plans[j], name))
    assert plan_chunk_step([None, None], **kw).num_padded_rows == 0


def test_split_into_chunks():
    idx, w = routes(*[[t, -1] for t in range(5)])
    chunks = split_into_chunks(idx, w, 2)
    assert [(c.chunk_index, c.token_base, c.num_tokens) for c in chunks] == [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    assert torch.equal(torch.cat([c.topk_idx for c in chunks]), idx)
    empty = split_into_chunks(torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, 3), 8)
    assert len(empty) == 1 and empty[0].num_tokens == 0 and empty[0].topk_idx.shape == (0, 3)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("experts_per_rank", [1, 3, 40])
def test_padded_rows_bound_is_reached(block_m, experts_per_rank):
    # Every source's full chunk: experts 0..g-2 get one row each, expert g-1 every other row.
    world, C, K = 3, 4, 2
    bound = padded_rows_bound(C, K, world, experts_per_rank, block_m)
    real = world * C * K
    flat = torch.full((real,), min(experts_per_rank, real) - 1, dtype=torch.int32)
    flat[:min(experts_per_rank, real) - 1] = torch.arange(min(experts_per_rank, real) - 1, dtype=torch.int32)
    idx = list(flat.reshape(world, C, K))
    w = [torch.ones(C, K)] * world
    plan = plan_streamed(idx, w, tokens_per_slot=C, dest_rank=0, world_size=world,
                         num_experts=world * experts_per_rank, block_m=block_m)
    assert len(plan) == 1 and plan[0].num_real_rows == real and plan[0].num_padded_rows == bound


def test_plan_repr_and_no_tensor_eq():
    idx, w = routes([0])
    plan = plan_batch([idx], [w], dest_rank=0, world_size=1, num_experts=1, block_m=4)
    assert "real_rows=1" in repr(plan) and "padded_rows=4" in repr(plan)
    assert plan != plan_batch([idx], [w], dest_rank=0, world_size=1, num_experts=1, block_m=4)  # identity eq


# -- validation: refused before any work, field named ------------------------------------------------------

GOOD_IDX, GOOD_W = routes([0, 1], [2, -1])
KW = dict(tokens_per_slot=2, dest_rank=0, world_size=2, num_experts=4, block_m=4)


def streamed_with(idx=None, w=None, **changes):
    idx = [GOOD_IDX, GOOD_IDX] if idx is None else idx
    w = [GOOD_W, GOOD_W] if w is None else w
    return plan_streamed(idx, w, **{**KW, **changes})


@pytest.mark.parametrize("call,field", [
    (lambda: streamed_with([GOOD_IDX.long(), GOOD_IDX]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX.tolist()]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX[0]], [GOOD_W, GOOD_W[0]]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX[:, :0]], [GOOD_W, GOOD_W[:, :0]]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX[:, :1]], [GOOD_W, GOOD_W[:, :1]]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX.to("meta")]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX]), "per_source_topk_idx"),
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX + 2]), "per_source_topk_idx"),  # 4 == num_experts
    (lambda: streamed_with([GOOD_IDX, GOOD_IDX - 2]), "per_source_topk_idx"),  # -3
    (lambda: streamed_with(w=[GOOD_W, GOOD_W.double()]), "per_source_topk_weights"),
    (lambda: streamed_with(w=[GOOD_W, GOOD_W[:1]]), "per_source_topk_weights"),
    (lambda: streamed_with(w=(GOOD_W,)), "per_source_topk_weights"),
    (lambda: streamed_with(world_size=0), "world_size"),
    (lambda: streamed_with(world_size=True), "world_size"),
    (lambda: streamed_with(num_experts=5), "num_experts"),
    (lambda: streamed_with(num_experts=0), "num_experts"),
    (lambda: streamed_with(block_m=0), "block_m"),
    (lambda: streamed_with(block_m=4.0), "block_m"),
    (lambda: streamed_with(dest_rank=2), "dest_rank"),
    (lambda: streamed_with(dest_rank=-1), "dest_rank"),
    (lambda: streamed_with(tokens_per_slot=0), "tokens_per_slot"),
    (lambda: plan_batch([GOOD_IDX], [GOOD_W], dest_rank=0, world_size=2, num_experts=4, block_m=1),
     "per_source_topk_idx"),
    (lambda: plan_chunk_step([None], dest_rank=0, world_size=2, num_experts=4, block_m=1), "chunks"),
    (lambda: plan_chunk_step([None, (GOOD_IDX, GOOD_W)], dest_rank=0, world_size=2, num_experts=4, block_m=1),
     "chunks"),
    (lambda: plan_chunk_step([ChunkRoute(GOOD_IDX, GOOD_W, 0, 0), ChunkRoute(GOOD_IDX, GOOD_W, 1, 2)],
                             dest_rank=0, world_size=2, num_experts=4, block_m=1), "chunks"),
    (lambda: plan_chunk_step([ChunkRoute(GOOD_IDX + 3, GOOD_W, 0, 0), None],
                             dest_rank=0, world_size=2, num_experts=4, block_m=1), "chunks"),
    (lambda: plan_chunk_step([None, None], dest_rank=0, world_size=2, num_experts=4, block_m=-1), "block_m"),
    (lambda: ChunkRoute(GOOD_IDX, GOOD_W.half(), 0, 0), "topk_weights"),
    (lambda: ChunkRoute(GOOD_IDX.float(), GOOD_W, 0, 0), "topk_idx"),
    (lambda: ChunkRoute(GOOD_IDX, GOOD_W, -1, 0), "chunk_index"),
    (lambda: ChunkRoute(GOOD_IDX, GOOD_W, 0, -2), "token_base"),
    (lambda: split_into_chunks(GOOD_IDX, GOOD_W, 0), "tokens_per_slot"),
    (lambda: split_into_chunks(GOOD_IDX, GOOD_W.T.contiguous()[:1], 2), "topk_weights"),
    (lambda: padded_rows_bound(0, 1, 1, 1, 1), "tokens_per_slot"),
    (lambda: padded_rows_bound(1, 0, 1, 1, 1), "topk"),
    (lambda: padded_rows_bound(1, 1, 0, 1, 1), "world_size"),
    (lambda: padded_rows_bound(1, 1, 1, 0, 1), "experts_per_rank"),
    (lambda: padded_rows_bound(1, 1, 1, 1, 0), "block_m"),
    (lambda: DispatchPlan(torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                          *[torch.zeros(1, dtype=torch.int32)] * 4, torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                          dest_rank=0, experts_per_rank=1, block_m=1), "src_rank"),
])
def test_bad_input_is_refused_with_the_field_named(call, field):
    with pytest.raises(ChunkringUsageError) as info:
        call()
    assert info.value.field == field, str(info.value)
