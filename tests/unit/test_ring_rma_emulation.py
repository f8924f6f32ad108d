"""The RMA data path (protocol/transport.cuh with RingDesc.rma_peers set; comm/rma.cuh) run on the CPU at 2 ranks,
the kernels emulated as written (tests/helpers/emulation/rma.py on ring.py, pull.py, world.py): every peer RMA
(``transport="rma"``, this rank too) or every other rank unmapped (``auto``: the peer RMA, this rank DIRECT).
A non-blocking get or put is pending - its destination unreadable, its target at the peer unwritten - until a quiet
that the code orders after it (rma.py's rule: the quieting warp's own earlier operations, the block's of an earlier
barrier interval).

What it pins: publish -> moe_pull through gets (meta and routing blocking, rows by warp-level non-blocking gets
completed by fetch_done) leaves every stage (x, sf, idx, w, held) equal to the DIRECT run's bit for bit and the
reference's; ``ExpertCompute.combine_push`` with the ring's descriptor takes the RMA branch of moe_combine_push
(each weighted row rewritten in place in ``out``, then a block put to the source's symmetric ``combine``, put_done),
then moe_ack_held, the owner's moe_drain and its reduction over k reading, through the checked memory, complete
combine rows equal to each local choice's bf16(out * weight). Mutants caught: put_done without its quiet (the
drain's reduction reads rows not landed), quiet_block without the barrier before thread 0's quiet (another warp's
get or put of that interval still pending: the pull's scale check, or the reduction, reads it).
What only a GPU shows: the proxy's real completion, memory ordering, off-node registration of local buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkring import MoEConfig, PayloadFormat
from chunkring.moe._engine.experts import DevicePlan
from chunkring.moe.gemm import GROUP_ALIGN
from tests.helpers.emulation import blocks as blocks_emu
from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation.machine import EmulatedMemoryError
from tests.helpers.emulation.plan_layout import expert_compute
from tests.helpers.emulation.rma import combine_push_launcher
from tests.helpers.emulation.world import E, H, K, N, World

RMA = [{"transport": "rma"}, {"unmapped": True}]
EL, SIZES = E // 2, [[4, 2, 3], [4, 1]]  # local experts per rank; each source's chunks


def pulled(monkeypatch, seed: int, grid: int = 2, mutate=None, **rma) -> World:
    w = World(monkeypatch, 2, PayloadFormat.FP8_E4M3, seed=seed, grid=grid, mutants={"moe_drain": blocks_emu.moe_drain},
              launchers=lambda heap: {"moe_combine_push": combine_push_launcher(heap, mutate)}, **rma)
    w.call(SIZES)
    w.expected.check(w.masked)
    return w


def stage_bytes(w: World) -> list[list[bytes]]:
    return [[getattr(s, name).contiguous().view(torch.uint8).numpy().tobytes() for name in ("x", "sf", "idx", "w",
                                                                                             "held")]
            for s in w.stages]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rma", RMA, ids=["rma", "unmapped"])
def test_an_rma_pull_lands_the_direct_runs_stages_bit_for_bit(monkeypatch, seed, rma):
    direct = pulled(monkeypatch, seed)
    remote = pulled(monkeypatch, seed, **rma)
    assert stage_bytes(remote) == stage_bytes(direct)
    remote.ack_held()
    remote.expected.check(remote.masked)


def unbarriered_pull(ring, a, part, parts):
    """Mutant: fetch_done's quiet_block without the barrier before thread 0's quiet."""
    ring.rma.barrier_before_quiet = False
    yield from pull_emu.moe_pull(ring, a, part, parts)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_quiet_before_the_other_warps_issued_their_gets_is_caught(monkeypatch, seed):
    w = World(monkeypatch, 2, PayloadFormat.FP8_E4M3, seed=seed, transport="rma",
              mutants={"moe_pull": unbarriered_pull})
    with pytest.raises(EmulatedMemoryError, match="uninitialised bytes of PE . stage sf"):
        w.call(SIZES)


def plan_of(w: World, r: int, gen: torch.Generator):
    """Rank r's plan of every local choice in its stage (group e: expert lo + e), ``out`` random bf16, and what each
    choice's combine row must hold: {(src, token * K + k): bf16 row}."""
    P, stage = EL * GROUP_ALIGN, w.stages[r]
    src, token, k = (torch.full((P,), -1, dtype=torch.int32) for _ in range(3))
    weight = torch.zeros(P)
    counts = torch.zeros(EL, dtype=torch.int32)
    out = torch.randn(P, H, generator=gen).bfloat16()
    want = {}
    for s, sizes in enumerate(SIZES):
        for t in range(sum(sizes)):
            for kk in range(K):
                e = int(stage.idx[s, t, kk]) - stage.expert_lo
                if 0 <= e < EL:
                    row = e * GROUP_ALIGN + int(counts[e])
                    counts[e] += 1
                    src[row], token[row], k[row], weight[row] = s, t, kk, stage.w[s, t, kk]
                    want[s, t * K + kk] = (out[row].float() * weight[row]).bfloat16()
    plan = DevicePlan(counts, counts.clone(), src, token, k, weight, torch.zeros(P, H, dtype=torch.uint8),
                      torch.zeros(H // 128, P), own_row=torch.full((N * K,), -1, dtype=torch.int32))
    return plan, out, want


def combine_and_drain(monkeypatch, w: World, seed: int) -> dict:
    """Every rank pushes its plan's rows (ExpertCompute.combine_push, the ring's descriptor), moe_ack_held; every
    owner moe_drain, then its reduction over k through the checked memory. Returns the rows each must hold."""
    config = MoEConfig(num_experts=E, hidden=H, intermediate=128, topk=K, max_tokens_per_rank=N,
                       payload=PayloadFormat.BF16)
    combine = [w.heap.alloc(r, (N * K, H), torch.bfloat16) for r in range(2)]  # symmetric, zeroed
    peer_combine = torch.tensor([c.data_ptr() for c in combine], dtype=torch.int64)
    gen, want, reduced = torch.Generator().manual_seed(seed), {}, {}
    for r, ring in enumerate(w.rings):
        w.memory.add(combine[r], f"PE {r} combine")
        compute = expert_compute(config, 2, r, EL, w.library, monkeypatch)
        plan, out, rows = plan_of(w, r, gen)
        want.update(rows)
        compute.combine_push(plan, out, peer_combine, desc=ring.desc, combine=combine[r])
        w.library.launch("moe_ack_held", desc=ring.desc, stage=w.stages[r].desc, pushed=compute.pushed,
                         push_blocks=compute.push_blocks, grid=2, block=32, stream=None, trace=None, trace_capacity=0)
    for r, ring in enumerate(w.rings):
        w.library.launch("moe_drain", desc=ring.desc, block=32, stream=None)
        w.streams.enqueue(("moe_drain", ring.desc.data_ptr()), [reduction(w, combine[r], reduced, r)])
    w.streams.run()
    return {"want": want, "combine": combine, "reduced": reduced}


def reduction(w: World, combine: torch.Tensor, reduced: dict, r: int):
    """schedule._drain_and_reduce's sum over k after the drain: every byte read through the checked memory."""
    alloc = w.memory.find(combine)
    rows = alloc.load(np.arange(combine.numel()) * 2, 2, f"PE {r}'s reduction of its combine rows").view(np.uint16)
    reduced[r] = torch.from_numpy(rows.astype(np.int16)).view(torch.bfloat16).view(N, K, H).float().sum(1)
    yield from ()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rma", RMA, ids=["rma", "unmapped"])
def test_combine_puts_land_complete_before_the_owners_drain_returns(monkeypatch, seed, rma):
    w = pulled(monkeypatch, seed, **rma)
    got = combine_and_drain(monkeypatch, w, seed)
    assert len(got["want"]) > 10
    for r, c in enumerate(got["combine"]):
        expect = torch.zeros(N * K, H, dtype=torch.bfloat16)
        for (s, at), row in got["want"].items():
            if s == r:
                expect[at] = row
        assert torch.equal(c.view(torch.int16), expect.view(torch.int16))
        assert torch.equal(got["reduced"][r], expect.view(N, K, H).float().sum(1))


def no_quiet(rb):
    rb.quiet_in_put_done = False


def no_barrier(rb):
    rb.barrier_before_quiet = False


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mutate", [no_quiet, no_barrier])
def test_a_combine_push_whose_puts_are_not_quieted_is_caught(monkeypatch, seed, mutate):
    w = pulled(monkeypatch, seed, mutate=mutate, transport="rma")
    with pytest.raises(EmulatedMemoryError, match="reduction of its combine rows: reads uninitialised"):
        combine_and_drain(monkeypatch, w, seed)
