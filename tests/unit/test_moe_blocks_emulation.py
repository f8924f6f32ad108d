"""The streamed call's waves path run whole on the CPU: every source publishes its chunks through
``chunkring.ring.io.publish_chunk`` (real Rings over the stand-in runtime, one symmetric heap, every peer DIRECT),
each rank's ``moe_pull_blocks`` lands every local (token, k) choice in a block of its expert while two waves
(``ExpertCompute.wave``: moe_wave_claim, moe_wave_gather, the decode GEMMs, the combine push) run beside it, then
``moe_ack_held``, ``moe_drain`` and ``moe_combine_reduce`` - all as written (tests/helpers/emulation/blocks.py on
ring.py, pull.py, waves.py, decode.py). The launches are the layer's: the pull by
``launch`` with exactly the keyword arguments ``schedule._pull_into_blocks`` passes (desc, arrivals,
stage, pool_desc, grid, block=PULL_BLOCK, stream, no trace), the waves by ``ExpertCompute.wave`` on the consumer
stream, moe_ack_held after them, the drain and the reduction over the routed choices (``ExpertCompute.reduce`` as
``schedule._drain_and_reduce`` calls it) on the producer stream after the publishes (not after the consumer's
stream: the drain's own wait is the edge).
The scheduler interleaves publishes, pull blocks (at their waits, between RESERVE and ALLOCATE, after each LAND)
and the claim (at its wait and between pool ids), by seed.

World size 1 (4 chunks through a 2-slot ring inside the call; ~256 and ~205 choices of the two local experts, so full
blocks seal at their last LAND and the first wave claims them while the pull runs on) and 2 (every peer DIRECT, one
source empty). What it pins, per rank and seed: every local choice in exactly one pool row of a block of its expert,
with its payload, scales, source, token, k and weight; every other choice NO_ROW; every allocated block sealed once with
its row count (landed = count, kSealed = pool_next) and claimed once over the waves; the gathered plans' rows
together exactly the local choices; sealed_all and kEnded = the grid; no error recorded; the combine rows every
local choice's, once, against float64, and no other row written (nothing zeroes them, and the reduction, which reads
only routed choices, never reads an unwritten row: the emulated memory would refuse it); the reduction read after the
drain equal to the complete one. Deliberate
mutants caught: blocks sealed at their last reservation (kSealOnReserve), and a pull acknowledging each source's
last chunk at once (kNoDeferredAck: the drain returns before the combine rows land).
What only a GPU shows: memory ordering (fences, acquire/release), RMA peers, timeouts, the timeline trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import chunkring.ring.io
from chunkring import MoEConfig, PayloadFormat, Ring
from chunkring.moe._engine.blocks import BlockPool, pool_shape
from chunkring.moe._engine.resources import PULL_BLOCK
from chunkring.moe._engine.stage import Stage
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.ring.io import publish_chunk
from chunkring.ring.layout import STATUS
from chunkring.ring.status import ErrorCode, Site
from tests.helpers.emulation import blocks as blocks_emu
from tests.helpers.emulation import decode as decode_emu
from tests.helpers.emulation.blocks import NO_ROW, WaveStreamLibrary
from tests.helpers.emulation.machine import EmptyTracker, EmulatedMemoryError, Memory
from tests.helpers.emulation.plan_layout import (
    combine_buffers,
    expert_compute,
    layer_rows,
    layer_weights,
    quantise_rows,
    relative_errors,
)
from tests.helpers.emulation.ring import HeapRuntime, Streams, SymmetricHeap
from tests.helpers.emulation.waves import CLAIMED_BIT, PoolLayout

EL, K, H, INTER, N, T, S, GRID = 2, 2, 256, 128, 256, 64, 2, 2  # local experts, ..., slots, pull blocks


class World:
    """W ranks' rings, stages, pools and expert computes on one emulated machine."""

    def __init__(self, monkeypatch, world: int, seed: int, mutants: dict | None = None) -> None:
        self.W, self.seed, heap, self.memory = world, seed, SymmetricHeap(world), Memory()
        tracker = EmptyTracker(monkeypatch)  # before any buffer: torch.empty memory holds nothing readable
        self.streams, self.claimed = Streams(self.memory, seed), []
        self.library = WaveStreamLibrary(
            self.memory, blocks_emu.kernels(heap, self.streams, mutants),
            blocks_emu.plain_kernels(seed, decode_emu.kernels([]), self.claimed), self.streams)
        self.library.initialised = tracker.initialised
        monkeypatch.setattr(chunkring.ring.io, "kernel_library", lambda runtime: self.library)
        self.config = MoEConfig(num_experts=EL * world, hidden=H, intermediate=INTER, topk=K, max_tokens_per_rank=N,
                                payload=PayloadFormat.FP8_E4M3, stream_slots=S, stream_slot_tokens=T, waves=2)
        spec = self.config.ring_spec(world, streamed=True)
        self.rings = [Ring(HeapRuntime(heap, r), spec, timeout_s=5.0, transport="auto") for r in range(world)]
        self.stages, self.pools, self.computes, self.weights = [], [], [], []
        # Nothing readable in a combine row until a push writes it: the reduction must never read a masked choice's.
        self.combine, self.peer_combine = combine_buffers(self.memory, world, N * K, H, initialised=False)
        for r, ring in enumerate(self.rings):
            self.memory.add(ring.buffer, f"PE {r} ring")
            self.memory.add(ring.desc, f"PE {r} ring desc")
            self.stages.append(self.stage(r))
            self.pools.append(self.pool(r))
            self.computes.append(expert_compute(self.config, world, r, EL, self.library, monkeypatch))
            self.memory.add(self.computes[r].pushed, f"PE {r} pushed")
            self.weights.append(layer_weights(self.memory, EL, H, INTER, seed=1 + r))
        self.arrivals = torch.zeros((world, world, S), dtype=torch.int32)  # per rank, LayerResources.arrivals
        self.gen = torch.Generator().manual_seed(seed)
        self.reduced: dict[int | str, torch.Tensor] = {}

    def stage(self, r: int) -> Stage:
        W = self.W
        stage = Stage(torch.zeros((W, N, H), dtype=torch.uint8).view(torch.float8_e4m3fn),
                      torch.zeros((W, N, H // 128)), torch.full((W, N, K), -1, dtype=torch.int32),
                      torch.zeros((W, N, K)), expert_lo=r * EL, expert_hi=(r + 1) * EL)
        for name in ("x", "sf", "idx", "w", "held", "desc"):
            self.memory.add(getattr(stage, name), f"PE {r} stage {name}")
        return stage

    def pool(self, r: int) -> BlockPool:
        pool = BlockPool(pool_shape(N, K, self.W, EL, GROUP_ALIGN), H, True, torch.device("cpu"))
        self.memory.add(pool.words, f"PE {r} pool words")
        self.memory.add(pool.desc, f"PE {r} pool desc")
        for name in ("pos", "x", "sf", "src", "token", "k", "weight"):  # torch.empty: nothing until the pull stores
            self.memory.add(getattr(pool, name), f"PE {r} pool {name}", initialised=False)
        return pool

    def batch(self, n: int):
        """x (e4m3), sf, idx (some -1, some out of range: masked), w of one source's n rows."""
        x, sf = (t[:n] for t in quantise_rows(torch.randn(max(n, 1), H, generator=self.gen)))
        # Per rank, its first expert about half the choices, its second 40% (full blocks sealed early), 10% -1.
        odds = torch.tensor([0.1 * self.W] + [0.5, 0.4] * self.W)
        idx = torch.multinomial(odds, max(n, 1) * K, replacement=True, generator=self.gen)[:n * K].view(n, K).int() - 1
        if n >= 3:  # an id past the experts and one below -1 (masked, counted), one row choosing expert 1 twice
            idx[:3] = torch.tensor([[EL * self.W + 1, 0], [-7, -1], [1, 1]], dtype=torch.int32)
        return x, sf, idx, torch.rand(n, K, generator=self.gen) + 0.5

    def call(self, sizes: list[int]) -> list:
        """One call, enqueued as schedule.enqueue enqueues it, then run; returns each source's batch."""
        batches = [self.batch(n) for n in sizes]
        for r in range(self.W):
            # _start_pull's reset. The layer's pull stream waits for it on the consumer stream; emulated streams have
            # no waits, so it runs ahead of the pull on the pull's own stream (the waves come after the pull's
            # blocks through their claims, moe_ack_held after the waves).
            self.library.stream = ("moe_pull_blocks", self.rings[r].desc.data_ptr())
            self.library.launch("moe_call_reset", stage=self.stages[r].desc, pushed=self.computes[r].pushed, grid=1,
                                block=PULL_BLOCK, stream=None)
        for src, (x, sf, idx, w) in enumerate(batches):
            for base in range(0, max(sizes[src], 1), T):
                rows = slice(base, min(base + T, sizes[src]))
                publish_chunk(self.rings[src], x=x[rows], x_sf=sf[rows], topk_idx=idx[rows], topk_weights=w[rows],
                              token_base=base, end_of_stream=base + T >= sizes[src])
        for r in range(self.W):
            self.consume(r)
            self.drain_and_reduce(r, sizes[r])
        self.streams.run()
        return batches

    def consume(self, r: int) -> None:
        """_pull_into_blocks and _waves, then moe_ack_held, on rank r's consumer stream."""
        ring, stage, pool, compute = self.rings[r], self.stages[r], self.pools[r], self.computes[r]
        self.library.stream = ("consumer", r)
        pool.reset()
        self.library.launch("moe_pull_blocks", desc=ring.desc, arrivals=self.arrivals[r], stage=stage.desc,
                            pool_desc=pool.desc, grid=GRID, block=PULL_BLOCK, stream=None, trace=None,
                            trace_capacity=0)
        w13, w2 = self.weights[r]
        for wave in range(2):
            compute.wave(pool, w13, w2, self.peer_combine, last=wave == 1, desc=ring.desc)
        self.library.launch("moe_ack_held", desc=ring.desc, stage=stage.desc, pushed=compute.pushed,
                            push_blocks=compute.push_blocks * 2, grid=self.W, block=32, stream=None, trace=None,
                            trace_capacity=0)

    def drain_and_reduce(self, r: int, n: int) -> None:
        """_drain_and_reduce on the producer stream (after the publishes): moe_drain, then the reduction over the
        routed choices (``ExpertCompute.reduce`` with this rank's own stage rows, as the schedule passes them)."""
        self.library.stream = ("publish", self.rings[r].desc.data_ptr())
        self.library.launch("moe_drain", desc=self.rings[r].desc, block=32, stream=None)
        self.reduced[r] = torch.empty((n, H), dtype=torch.bfloat16)
        self.computes[r].reduce(self.combine[r], self.stages[r].idx[r], self.stages[r].w[r], self.reduced[r],
                                desc=self.rings[r].desc)


def local_choices(batches, r: int) -> dict[tuple[int, int, int], int]:
    """Rank r's choices: (source, token, k) -> local expert."""
    out = {}
    for s, (_, _, idx, _) in enumerate(batches):
        for t, k in torch.nonzero((idx >= r * EL) & (idx < (r + 1) * EL)).tolist():
            out[(s, t, k)] = int(idx[t, k]) - r * EL
    return out


def pool_rows(w: World, r: int, batches) -> dict[tuple[int, int, int], int]:
    """Every local choice in one pool row of a block of its expert, with its row's contents; every other choice
    NO_ROW. Returns each choice's pool row."""
    pool, choices = w.pools[r], local_choices(batches, r)
    L = PoolLayout(*(getattr(pool.shape, f) for f in ("experts", "blocks_per_expert", "blocks", "block_m")))
    words, pos = pool.words.numpy().view(np.uint32), pool.pos.numpy().view(np.uint32).reshape(w.W, N, K)
    rows = {c: int(pos[c]) for c in choices}
    assert NO_ROW not in rows.values() and len(set(rows.values())) == len(rows), "one pool row each"
    for (s, t, k), e in choices.items():
        q, (x, sf, _, wt) = rows[(s, t, k)], batches[s]
        assert words[L.expert_of(q // L.block_m)] == e, "a block of its expert"
        assert (int(pool.src[q]), int(pool.token[q]), int(pool.k[q])) == (s, t, k)
        assert pool.weight[q].item() == wt[t, k].item()
        assert torch.equal(pool.x[q], x[t].view(torch.uint8)) and torch.equal(pool.sf[q], sf[t])
    for s, (_, _, idx, _) in enumerate(batches):
        for t, k in np.ndindex(idx.shape[0], K):
            if (s, t, k) not in choices:
                assert pos[s, t, k] == NO_ROW, f"choice {(s, t, k)} is not local"
    return rows


def check_blocks(w: World, r: int, rows: dict) -> None:
    """Every allocated block sealed once with its row count and claimed once over the waves; the counters."""
    pool = w.pools[r]
    L = PoolLayout(*(getattr(pool.shape, f) for f in ("experts", "blocks_per_expert", "blocks", "block_m")))
    words = pool.words.numpy().view(np.uint32)
    allocated = int(words[L.counter("kPoolNext")])
    count = np.bincount([q // L.block_m for q in rows.values()], minlength=allocated)
    assert len(count) == allocated and (count > 0).all(), "no block without a row"
    for i in range(allocated):
        assert words[L.state(i)] == CLAIMED_BIT | count[i] and words[L.landed(i)] == count[i]
    counters = [int(words[L.counter(c)]) for c in ("kSealed", "kClaimed", "kSealedAll", "kEnded")]
    assert counters == [allocated, allocated, 1, GRID]
    claims = [ids for at, ids, _ in w.claimed if at == pool.words.data_ptr()]
    assert len(claims) == 2 and sorted(claims[0] + claims[1]) == list(range(allocated)), "each block claimed once"


def check_plans(w: World, r: int, batches) -> None:
    """The two waves' gathered plans: their rows together exactly the local choices, with their weights."""
    got = []
    for name, _, _, launched in w.library.launches:
        a = launched.get("args")
        if name == "moe_wave_gather" and a["pool_desc"] is w.pools[r].desc:
            real = a["row_src"] >= 0
            got += zip(a["row_src"][real].tolist(), a["row_token"][real].tolist(), a["row_k"][real].tolist(),
                       strict=True)
            for s, t, k, wt in zip(a["row_src"][real], a["row_token"][real], a["row_k"][real],
                                   a["row_weight"][real], strict=True):
                assert wt.item() == batches[int(s)][3][int(t), int(k)].item()
    assert sorted(got) == sorted(local_choices(batches, r)), "the plans' rows: exactly the local choices"


def check_layer(w: World, batches, sizes: list[int]) -> None:
    """The combine rows of every local choice at every rank (and nothing else), against float64; the
    reduction each producer read after its drain equal to the complete one."""
    X = torch.zeros((w.W, N, H), dtype=torch.uint8).view(torch.float8_e4m3fn)
    SF, WT = torch.ones((w.W, N, H // 128)), torch.zeros((w.W, N, K))
    for s, (x, sf, _, wt) in enumerate(batches):
        X[s, :len(x)], SF[s, :len(x)], WT[s, :len(x)] = x, sf, wt
    want = {}
    for r in range(w.W):
        choices = local_choices(batches, r)
        per_expert = [sorted(c for c, e in choices.items() if e == ex) for ex in range(EL)]
        want.update(layer_rows(per_expert, X, SF, WT, *w.weights[r]))
    assert max(relative_errors(w.combine, want)) < 2.0**-7
    for s, c in enumerate(w.combine):
        untouched = [slot for slot in range(N * K) if (s, slot) not in want]
        assert c[untouched].isnan().all(), "no combine row but the local choices'"
        complete = torch.zeros((sizes[s], H))
        for t in range(sizes[s]):  # fp32 in k order over the routed choices, rounded once
            for k in range(K):
                if (s, t * K + k) in want:
                    complete[t] += c[t * K + k].float()
        assert torch.equal(w.reduced[s], complete.to(torch.bfloat16)), "complete at drain"


def check_call(w: World, batches, sizes: list[int]) -> None:
    assert not w.arrivals.any(), "a call leaves every arrival count at zero: calls do not zero them"
    for r, ring in enumerate(w.rings):
        assert ring.status().ok, ring.status()
        check_blocks(w, r, pool_rows(w, r, batches))
        check_plans(w, r, batches)
    check_layer(w, batches, sizes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_rank_lands_every_choice_in_a_block_the_waves_claim_once(monkeypatch, seed):
    w = World(monkeypatch, 1, seed)
    sizes = [N]  # 4 chunks through 2 slots; ~256 and ~205 choices: blocks sealed by LAND, partial ones
    batches = w.call(sizes)
    check_call(w, batches, sizes)
    sites = " ".join(w.streams.waits_seen)
    assert "kWaitBlocks" in sites and "kWaitAllocation" in sites, "a claim waited for the pull, a lane for ALLOCATE"
    first, _ = [(ids, sealed_all) for _, ids, sealed_all in w.claimed]
    assert len(first[0]) == 2 and first[1] == 0, "the first wave claimed full blocks while the pull ran on"


@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_sealed_at_their_last_reservation_are_caught(monkeypatch, seed):
    """kSealOnReserve: a full block sealed when its last row is reserved, before its rows land. A wave claims it
    with rows in flight: the claim records INTERNAL at BLOCKS (count, landed), the gather reads a row never
    stored."""
    w = World(monkeypatch, 1, seed, mutants={"moe_pull_blocks": blocks_emu.moe_pull_blocks_sealing_on_reserve})
    # The first read of bytes never stored: the gather's of a row still in flight, or - the claim's error aborts
    # the drain at once - the reduction's of a combine row no wave pushed; whichever the schedule reaches first.
    with pytest.raises(EmulatedMemoryError, match="uninitialised bytes of (PE 0 pool|combine)"):
        w.call([N])
    got = w.rings[0].status()
    assert (got.code, got.site, got.expected) == (ErrorCode.INTERNAL, Site.BLOCKS, GROUP_ALIGN)
    assert got.observed < GROUP_ALIGN


@pytest.mark.parametrize("seed", [0, 1])
def test_a_pull_that_acknowledges_last_chunks_lets_the_drain_return_before_the_combine(monkeypatch, seed):
    """kNoDeferredAck: the pull acknowledges each source's last chunk at once, so the producer's drain returns
    and its reduction over k runs before the waves' combine rows land: it reads a routed choice's row that no push
    has written yet (the emulated memory refuses it; on a GPU the sum takes a stale row)."""
    w = World(monkeypatch, 1, seed, mutants={"moe_pull_blocks": blocks_emu.moe_pull_blocks_acking_every_chunk})
    with pytest.raises(EmulatedMemoryError, match="combine row: reads uninitialised bytes of combine"):
        w.call([N])
    assert w.rings[0].status().ok


@pytest.mark.parametrize(("seed", "sizes"), [(0, [N, 100]), (1, [N, 100]), (2, [0, 130])])
def test_two_ranks_pull_each_other_into_blocks_and_drain_complete(monkeypatch, seed, sizes):
    """World size 2, every peer DIRECT: each rank's blocks hold both sources' choices of its experts, its waves
    push to both sources' combine buffers, and each producer's drain returns only after both consumers' held
    acks (an empty source sends one empty chunk)."""
    w = World(monkeypatch, 2, seed)
    batches = w.call(sizes)
    check_call(w, batches, sizes)


def test_a_reduction_after_a_recorded_error_returns_zeros_not_the_rows_it_finds(monkeypatch):
    """A call whose drain gave up (its error recorded in the call's ring) may find another call's rows in its combine
    buffer: its reduction, given the ring (as the schedule gives it), writes zeros instead. The same reduction
    without the error sums the rows the call left."""
    w = World(monkeypatch, 2, 0)
    sizes = [N, 100]
    batches = w.call(sizes)
    check_call(w, batches, sizes)
    r = 1
    complete = w.reduced[r].clone()
    w.rings[r].views["status"][STATUS["code"]] = int(ErrorCode.TIMEOUT)  # as record_error leaves it
    for desc, name in ((w.rings[r].desc, "failed"), (None, "no ring")):
        w.reduced[name] = torch.full_like(complete, float("nan"))
        w.library.stream = ("publish", w.rings[r].desc.data_ptr())
        w.computes[r].reduce(w.combine[r], w.stages[r].idx[r], w.stages[r].w[r], w.reduced[name], desc=desc)
        w.streams.run()
    assert complete.any() and not w.reduced["failed"].any(), "zeros, never the rows found"
    assert torch.equal(w.reduced["no ring"], complete)
