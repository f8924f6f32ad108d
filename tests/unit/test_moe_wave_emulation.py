"""One call's waves of incremental expert blocks run whole on the CPU: ExpertCompute.wave launches moe_wave_claim and
moe_wave_gather (tests/helpers/emulation/waves.py: as written, the claim's protocol calls reduced to one thread in
sequence) and, on the plan the gather fills, the decode kernels and the combine push (tests/helpers/emulation/decode.py;
the push takes the ring descriptor, no RMA peers). The pool (BlockPool on pool_shape, as the layer builds it) is
filled between the waves as moe_pull_blocks leaves it, step by step (RESERVE + ALLOCATE, STORE, LAND with the seal of
a full block, the finisher's partial seals; docs/PROTOCOL.md "Incremental expert blocks"), rows in flight (reserved,
not landed) left unwritten. The ring descriptor is RingLayout's, over a zeroed ring buffer whose status words
receive any error record.

What it pins: a wave claims exactly the blocks sealed when it looks (a non-last wave once E are sealed and
unclaimed, the last one after the finisher), each block once over the call, wave_ids without repeats, counts per
expert the claimed rows, the gathered plan in the batch plan's layout for exactly the claimed rows (tests/helpers/
plan_layout.py, as for moe_plan_scatter), the exit test (claimed == pool_next after the last wave) silent when it
holds and recorded when a block was never sealed, a block sealed before its rows landed recorded (and its rows then
unreadable), waits that cannot finish reported as waits (including claims counted ahead of the seals: no u32 wrap),
an earlier error ending the wave with nothing claimed, and the layer's combine rows over both waves against float64.

What only a GPU shows (tests/gpu/test_wave_claim.py, the layer's streamed tests): the pull running concurrently,
acquire/release ordering, the watchdog's timeout, other ranks' abort words."""

from __future__ import annotations

import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat
from chunkring.moe._engine.blocks import HEADER_WORDS, BlockPool, pool_shape
from chunkring.moe._engine.experts import DevicePlan
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.ring.layout import RingLayout
from chunkring.ring.status import ErrorCode, Site, StatusRecord
from tests.helpers.emulation import decode as decode_emu
from tests.helpers.emulation import waves as waves_emu
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
from tests.helpers.emulation.waves import CLAIMED_BIT, COUNT_MASK, SEALED_BIT, EmulatedWaitBlocks, PoolLayout

W, E, RANK, K, N, H, INTER = 2, 2, 1, 2, 110, 256, 128
COUNTS = (260, 130)  # expert 0: blocks of 128, 128, 4; expert 1: 128, 2 - the pool's P = 5 blocks, all used


@dataclass
class Pull:
    """moe_pull_blocks's effect on the pool, step by step as its lanes take them (one lane at a time)."""

    pool: BlockPool
    memory: Memory
    x: torch.Tensor  # the sources' rows [W, N, H] e4m3, sf [W, N, H/128], w [W, N, K]
    sf: torch.Tensor
    w: torch.Tensor

    def __post_init__(self) -> None:
        s = self.pool.shape
        self.L = PoolLayout(s.experts, s.blocks_per_expert, s.blocks, s.block_m)
        self.words = self.pool.words.numpy().view(np.uint32)  # the tensor's bytes: what the kernels see
        self.row: dict[tuple[int, int, int, int], int] = {}
        self.memory.add(self.pool.words, "pool words")  # zeroed by BlockPool.reset's memset
        for name in ("x", "sf", "src", "token", "k", "weight"):  # torch.empty: nothing before the pull stores it
            self.memory.add(getattr(self.pool, name), f"pool {name}", initialised=False)

    def reserve(self, choice) -> None:
        """RESERVE, then ALLOCATE at a block's offset 0 (any other offset: the block is allocated already)."""
        s, t, k, e = choice
        L, words = self.L, self.words
        r = int(words[L.reserve(e)])
        words[L.reserve(e)] += 1
        j, o = divmod(r, L.block_m)
        if o == 0:
            i = int(words[L.counter("kPoolNext")])
            words[L.counter("kPoolNext")] += 1
            words[L.expert_of(i)], words[L.block_of(e, j)] = e, i + 1
        self.row[choice] = (int(words[L.block_of(e, j)]) - 1) * L.block_m + o

    def land(self, choice) -> None:
        """STORE the row, LAND it, and SEAL its block if it completed it."""
        s, t, k, e = choice
        p, L, words = self.row[choice], self.L, self.words
        for name, value in (("x", self.x[s, t].view(torch.uint8)), ("sf", self.sf[s, t]), ("src", s), ("token", t),
                            ("k", k), ("weight", self.w[s, t, k])):
            getattr(self.pool, name)[p] = value
            self.memory.find(getattr(self.pool, name)).valid.reshape(self.pool.shape.rows, -1)[p] = True
        i = p // L.block_m
        words[L.landed(i)] += 1
        if words[L.landed(i)] == L.block_m:
            words[L.state(i)] = SEALED_BIT | L.block_m
            words[L.counter("kSealed")] += 1

    def finish(self) -> None:
        """The finisher: seal every expert's partial block, then sealed_all."""
        L, words = self.L, self.words
        for e in range(L.experts):
            c = min(int(words[L.reserve(e)]), L.blocks_per_expert * L.block_m)
            if c % L.block_m:
                i = int(words[L.block_of(e, c // L.block_m)]) - 1
                assert words[L.landed(i)] == c % L.block_m
                words[L.state(i)] = SEALED_BIT | c % L.block_m
                words[L.counter("kSealed")] += 1
        words[L.counter("kSealedAll")] = 1

    def sealed_unclaimed(self) -> set[int]:
        states = self.words[[self.L.state(i) for i in range(self.L.blocks)]]
        return {i for i, st in enumerate(states.tolist()) if st & SEALED_BIT and not st & CLAIMED_BIT}


def sources(gen: torch.Generator):
    """The sources' rows and routing: local expert e (global RANK * E + e) chosen COUNTS[e] times, the other
    choices the other rank's experts; returns (x, sf, w, each expert's choices (s, t, k, e) in a random order)."""
    x, sf = quantise_rows(torch.randn(W, N, H, generator=gen))
    w = torch.rand(W, N, K, generator=gen) + 0.5
    slots = torch.randperm(W * N * K, generator=gen)
    idx = torch.randint(0, E, (W * N * K,), generator=gen)  # rank 0's experts
    at = 0
    for e, n in enumerate(COUNTS):
        idx[slots[at:at + n]] = RANK * E + e
        at += n
    choices = [[(s, t, k, e) for s, t, k in torch.nonzero(idx.view(W, N, K) == RANK * E + e).tolist()]
               for e in range(E)]
    return x, sf, w, [[c[i] for i in torch.randperm(len(c), generator=gen).tolist()] for c in choices]


def setup(monkeypatch, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    config = MoEConfig(num_experts=E * W, hidden=H, intermediate=INTER, topk=K, max_tokens_per_rank=N,
                       payload=PayloadFormat.FP8_E4M3, stream_slots=2, stream_slot_tokens=N // 4, waves=2)
    memory, ranks, src_stores = Memory(), [], []

    def gather(memory, grid, block, shared_bytes, a):  # and the src stores it made (the plan's prefill aside)
        waves_emu.kernels(seed)["moe_wave_gather"](memory, grid, block, shared_bytes, a)
        src_stores.append(a.row_src.stores.copy())

    kernels = {**waves_emu.kernels(seed, ranks), "moe_wave_gather": gather, **decode_emu.kernels([])}
    library = EmulatedLibrary(memory, kernels, initialised=EmptyTracker(monkeypatch).initialised)
    pool = BlockPool(pool_shape(N, K, W, E, GROUP_ALIGN), H, True, torch.device("cpu"))
    ring = RingLayout(config.ring_spec(W, streamed=True))
    buffer = torch.zeros(ring.total_bytes, dtype=torch.uint8)
    desc = torch.from_numpy(ring.descriptor(my_pe=RANK, base=buffer.data_ptr(), timeout_ns=10**9).view(np.int64))
    memory.add(buffer, "ring buffer")
    memory.add(desc, "ring desc")
    x, sf, w, choices = sources(gen)
    w13, w2 = layer_weights(memory, E, H, INTER)
    combine, peer_combine = combine_buffers(memory, W, N * K, H)
    compute = expert_compute(config, W, RANK, E, library, monkeypatch)
    memory.add(compute.pushed, "pushed")
    return types.SimpleNamespace(pull=Pull(pool, memory, x, sf, w), compute=compute, library=library, memory=memory,
                                 ranks=ranks, src_stores=src_stores, desc=desc, status=ring.views(buffer)["status"],
                                 choices=choices, w13=w13, w2=w2, combine=combine, peer_combine=peer_combine,
                                 gen=gen)


def wave(r, last: bool):
    """ExpertCompute.wave, then what it claimed (wave_ids) and the plan its gather filled."""
    r.compute.wave(r.pull.pool, r.w13, r.w2, r.peer_combine, last=last, desc=r.desc)
    L, words = r.pull.L, r.pull.words
    claimed = words[L.wave_ids():L.wave_ids() + int(words[L.counter("kWaveCount")])].tolist()
    args = [a["args"] for name, _, _, a in r.library.launches if name == "moe_wave_gather"][-1]
    plan = DevicePlan(counts=args["counts"], group_end=args["group_end"], src=args["row_src"], token=args["row_token"],
                      k=args["row_k"], weight=args["row_weight"], rows=args["rows"], rows_sf=args["rows_sf"],
                      own_row=torch.empty(0, dtype=torch.int32))  # a wave's gather fills no own rows
    return claimed, plan


def check_wave(r, claimed: list[int], sealed: set[int], plan) -> None:
    """The wave claimed exactly the blocks sealed and unclaimed when it looked, once each, and gathered exactly
    their rows into the batch plan's layout."""
    L, words = r.pull.L, r.pull.words
    assert len(claimed) == len(set(claimed)) and set(claimed) == sealed, "every sealed block, once"
    n = {i: int(words[L.state(i)]) & COUNT_MASK for i in claimed}
    assert all(words[L.state(i)] == CLAIMED_BIT | n[i] for i in claimed)
    def in_claimed_block(choice) -> bool:
        return choice in r.pull.row and r.pull.row[choice] // L.block_m in n

    per_expert = [sorted(c[:3] for c in of_expert if in_claimed_block(c)) for of_expert in r.choices]
    assert plan.counts.tolist() == [len(c) for c in per_expert]
    assert plan.counts.tolist() == [sum(n[i] for i in claimed if words[L.expert_of(i)] == e) for e in range(E)]
    real = check_layout(plan, per_expert, r.pull.x, r.pull.sf, r.pull.w)
    check_written(r.memory, plan, real, r.src_stores[-1])


def status(r) -> StatusRecord:
    return StatusRecord.from_words(r.status.tolist())


def interleaved(rng, *lists):
    """The lists' items in a random interleaving that keeps each list's order (lanes of different rows reserve in
    any order; one expert's reservations follow its list)."""
    labels = rng.permutation(np.repeat(np.arange(len(lists)), [len(x) for x in lists]))
    at = [0] * len(lists)
    out = []
    for label in labels.tolist():
        out.append(lists[label][at[label]])
        at[label] += 1
    return out


def test_two_waves_claim_every_block_once_and_compute_the_layer(monkeypatch):
    r = setup(monkeypatch)
    assert r.pull.L.wave_ids() + r.pull.L.blocks == r.pull.pool.shape.words and HEADER_WORDS == 8
    (e0, e1), rng = r.choices, np.random.default_rng(0)
    landed, in_flight = e0[:258] + e1[:129], [e0[258], e1[129]]  # two full blocks of e0, one of e1; partials
    for c in interleaved(rng, e0[:259], e1[:130]):  # the in-flight rows reserved last: in the partial blocks
        r.pull.reserve(c)
    for c in [landed[i] for i in rng.permutation(len(landed))]:
        r.pull.land(c)
    sealed = r.pull.sealed_unclaimed()
    assert len(sealed) == 3 and r.compute.wave_min_blocks == E
    claimed, plan = wave(r, last=False)
    check_wave(r, claimed, sealed, plan)
    rest = e0[259:] + e1[130:]
    for c in interleaved(rng, e0[259:], e1[130:]):
        r.pull.reserve(c)
    for c in [(rest + in_flight)[i] for i in rng.permutation(len(rest) + len(in_flight))]:
        r.pull.land(c)
    r.pull.finish()
    sealed_later = r.pull.sealed_unclaimed()
    assert len(sealed_later) == 2
    claimed_later, plan = wave(r, last=True)
    check_wave(r, claimed_later, sealed_later, plan)
    L, words = r.pull.L, r.pull.words
    assert words[L.counter("kClaimed")] == words[L.counter("kPoolNext")] == L.blocks == 5
    assert status(r).ok and r.ranks[-1].aborts_sent == [], "the exit test holds: nothing recorded"
    want = layer_rows([sorted(c[:3] for c in of_expert) for of_expert in r.choices], r.pull.x, r.pull.sf, r.pull.w,
                      r.w13, r.w2)
    assert written_slots(r.combine) == set(want), "both waves' combine rows: every local choice's, once"
    assert max(relative_errors(r.combine, want)) < 2.0**-7
    assert int(r.compute.pushed) == 2 * r.compute.push_blocks


def pull_all(r, *, hold=(), finish: bool = True) -> None:
    """The whole pull but the rows in ``hold`` (reserved, not landed), then the finisher if asked."""
    rng = np.random.default_rng(1)
    for c in interleaved(rng, *r.choices):
        r.pull.reserve(c)
    rows = [c for of_expert in r.choices for c in of_expert if c not in hold]
    for i in rng.permutation(len(rows)):
        r.pull.land(rows[i])
    if finish:
        r.pull.finish()


def set_word(r, counter: str, value: int) -> None:
    r.pull.words[r.pull.L.counter(counter)] = value


@pytest.mark.parametrize("state", ["one sealed", "last before the finisher", "claims counted ahead"])
def test_a_wave_that_must_wait_is_reported_as_waiting(state, monkeypatch):
    """No wait passes silently: a non-last wave with fewer than E sealed, unclaimed blocks, a last wave before
    sealed_all, and seals counted behind the claims (a sealer counts its seal after storing it: the difference is
    0 there, not the u32 wrap, which would start a wave at once with nothing to claim) each wait for the pull."""
    r = setup(monkeypatch)
    pull_all(r, hold=(r.choices[0][0],), finish=False)  # expert 0's first block waits for a row
    if state == "one sealed":
        assert len(r.pull.sealed_unclaimed()) == 2
        set_word(r, "kSealed", 1)  # the second seal's count not in yet
    elif state == "claims counted ahead":
        set_word(r, "kClaimed", 3)
    last = state == "last before the finisher"
    with pytest.raises(EmulatedWaitBlocks, match="kWaitBlocks would wait"):
        wave(r, last=last)


@pytest.mark.parametrize("earlier", ["this rank's error", "a peer's abort"])
def test_a_wave_after_an_error_claims_nothing(earlier, monkeypatch):
    """A wait that cannot finish stops at this rank's recorded error, or at a peer's abort word (recorded as
    PEER_ABORTED naming it): the wave then claims nothing, gathers nothing, pushes no row."""
    r = setup(monkeypatch)
    pull_all(r, finish=False)
    set_word(r, "kSealed", 0)
    word = (7 << 16) | (0 << 8) | ErrorCode.TIMEOUT  # rank 0's timeout in epoch 7
    if earlier == "this rank's error":
        r.status[0], r.status[7] = ErrorCode.TIMEOUT, 1
    else:
        r.status[15] = word
    before = status(r)
    claimed, plan = wave(r, last=False)
    assert claimed == [] and plan.counts.tolist() == [0, 0] and (plan.src == -1).all()
    assert written_slots(r.combine) == set()
    if earlier == "this rank's error":
        assert status(r) == before, "no second record"
    else:
        got = status(r)
        assert (got.code, got.site, got.observed, got.count) == (ErrorCode.PEER_ABORTED, Site.WAIT_BLOCKS, word, 1)


def test_the_exit_test_records_a_block_never_sealed(monkeypatch):
    """The last wave's exit test: a partial block the finisher did not seal is left behind - recorded (INTERNAL at
    BLOCKS: allocated, claimed), the abort raised to the other rank; the sealed blocks are still computed."""
    r = setup(monkeypatch)
    pull_all(r)
    L, words = r.pull.L, r.pull.words
    partial = next(i for i in range(L.blocks) if words[L.state(i)] & COUNT_MASK < L.block_m)
    words[L.state(partial)] = 0
    claimed, plan = wave(r, last=True)
    check_wave(r, claimed, set(range(L.blocks)) - {partial}, plan)
    got = status(r)
    assert (got.code, got.site, got.pe, got.slot, got.expected, got.observed) == (
        ErrorCode.INTERNAL, Site.BLOCKS, RANK, 0, 5, 4)
    word = int(r.status[15])
    assert word & 0xFF == ErrorCode.INTERNAL and word >> 8 & 0xFF == RANK
    assert r.ranks[-1].aborts_sent == [(0, word)]


def test_a_block_sealed_before_its_rows_landed_is_recorded(monkeypatch):
    """A full block sealed with a row still in flight (the kSealOnReserve mutant's seal): its claimant records
    INTERNAL at BLOCKS (block, count, landed) - and the gather then reads the row nothing stored."""
    r = setup(monkeypatch)
    late = r.choices[1][5]
    pull_all(r, hold=(late,), finish=False)
    L, words = r.pull.L, r.pull.words
    block = r.pull.row[late] // L.block_m
    words[L.state(block)] = SEALED_BIT | L.block_m
    words[L.counter("kSealed")] += 1
    with pytest.raises(EmulatedMemoryError, match="uninitialised bytes of pool"):
        wave(r, last=False)
    got = status(r)
    assert (got.code, got.site, got.slot, got.expected, got.observed) == (
        ErrorCode.INTERNAL, Site.BLOCKS, block, L.block_m, L.block_m - 1)


def test_a_pool_whose_blocks_are_not_the_plans_groups_is_refused_before_any_launch(monkeypatch):
    """The gather aligns each expert's group to the pool's block, SwiGLU and the combine push to GROUP_ALIGN: one
    plan layout needs both the same, so another pool is a typed error before anything is enqueued."""
    r = setup(monkeypatch)
    odd = BlockPool(pool_shape(N, K, W, E, GROUP_ALIGN // 2), H, True, torch.device("cpu"))
    with pytest.raises(ChunkringUsageError, match="128 rows, got 64") as info:
        r.compute.wave(odd, r.w13, r.w2, r.peer_combine, last=True, desc=r.desc)
    assert info.value.field == "pool" and r.library.launches == []
