"""The ring's data path run whole on the CPU: ``chunkring.ring.io.publish_chunk`` launches its publish kernels
(ring_publish_tensors, or ring_publish_open/_copy/_close where a chunk is too large for one block) and the layer's
``moe_pull`` reads every source's chunks into the stage through its StageDesc - both emulated as written
(tests/helpers/emulation/pull.py on tests/helpers/emulation/ring.py). The pull is launched as
``schedule._launch_pull`` launches it (``desc=ring.desc``, ``arrivals``, ``stage=stage.desc``, the pull grid,
``block=PULL_BLOCK``, no trace), by ``launch`` on the emulated library; ``moe_ack_held`` as the layer launches it
after the combine. Rings are real :class:`chunkring.Ring` objects over a stand-in runtime per rank, one symmetric
heap: world size 1, and 2 with both ranks in this process and every peer DIRECT. Publishes and pulls run
concurrently (streams interleaved, blocks in a seeded order), so a ring of 2 slots wraps inside one call: the third
chunk's publish waits for the pull's acknowledgement of the first.

What it pins, against tests/helpers/emulation/pull_reference.py: every source's rows at their token index in the stage
(``x``, ``sf`` of rows with a local choice; ``idx`` with out-of-range ids masked to -1 and every other id kept
global, non-local ones included; ``w``), ``held[src]`` the seq of its last chunk, the ack words of every other chunk
written (and the held ones after moe_ack_held), the cursors, ready and consumed words, nothing else written
anywhere in the rings or stages; masked inputs counted; every read of a slot inside its wait .. ack window; FP8
and bf16, chunks below and at tokens_per_slot, an empty source, grids of 1 and 3 blocks (arrival counting), a
second call on the same ring (laps continue); a producer writing a slot only after every ack of its previous lap.
Two deliberate mutants are caught: a pull that acknowledges before it reads, a publish that does not wait for acks.
What only a GPU shows: memory ordering (the fences), RMA peers, the timeline trace, timeouts."""

from __future__ import annotations

import pytest
import torch

import chunkring.ring.io
from chunkring import PayloadFormat, Ring, RingSpec
from chunkring.moe.resources import PULL_BLOCK
from chunkring.moe.stage import Stage
from chunkring.ring.io import publish_chunk
from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation.machine import EmulatedMemoryError, Memory
from tests.helpers.emulation.pull_reference import SENTINEL, Batch, Expected
from tests.helpers.emulation.ring import HeapRuntime, StreamLibrary, Streams, SymmetricHeap
from tests.helpers.emulation.waves import EmulatedWaitBlocks

S, T, H, K, E, N = 2, 4, 128, 2, 4, 12  # slots, tokens per slot, hidden, topk, experts, stage rows per source


class World:
    """W ranks' rings and stages on one emulated machine, publish_chunk's library seam pointed at it."""

    def __init__(self, monkeypatch, world: int, payload: PayloadFormat, *, seed: int = 0, grid: int = 1,
                 mutants: dict | None = None) -> None:
        heap, self.memory = SymmetricHeap(world), Memory()
        self.streams = Streams(self.memory, seed)
        self.library = StreamLibrary(self.memory, pull_emu.kernels(heap, self.streams, mutants), self.streams)
        monkeypatch.setattr(chunkring.ring.io, "kernel_library", lambda runtime: self.library)
        spec = RingSpec(world_size=world, num_slots=S, tokens_per_slot=T, hidden=H, payload=payload, topk=K,
                        num_experts=E)
        self.rings = [Ring(HeapRuntime(heap, r), spec, timeout_s=5.0, transport="auto") for r in range(world)]
        assert all(pe == 0 for ring in self.rings for pe in ring.transports)  # every peer DIRECT
        self.stages = [self.stage(spec, r) for r in range(world)]
        for r, ring in enumerate(self.rings):
            self.memory.add(ring.buffer, f"PE {r} ring")
        self.grid, self.gen, self.spec = grid, torch.Generator().manual_seed(seed), spec
        self.expected = Expected(self.rings, self.stages, E)
        self.masked = [0] * world
        self.arrivals = torch.zeros((world, S), dtype=torch.int32)  # LayerResources.arrivals of the mode

    def stage(self, spec: RingSpec, rank: int) -> Stage:
        W, fp8 = spec.world_size, spec.payload is PayloadFormat.FP8_E4M3
        x = torch.full((W, N, H * (1 if fp8 else 2)), SENTINEL["x"], dtype=torch.uint8)
        x = x.view(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        sf = torch.full((W, N, H // 128 if fp8 else 0), SENTINEL["sf"])
        lo, hi = (1, 3) if W == 1 else (rank * E // W, (rank + 1) * E // W)  # one rank: a part of the experts
        stage = Stage(x, sf, torch.full((W, N, K), -1, dtype=torch.int32), torch.full((W, N, K), SENTINEL["w"]),
                      expert_lo=lo, expert_hi=hi)
        for name in ("x", "sf", "idx", "w", "held"):
            if getattr(stage, name).numel():
                self.memory.add(getattr(stage, name), f"PE {rank} stage {name}")
        return stage

    def batch(self, sizes: list[int]) -> Batch:
        """Rows with every kind of choice: local to one rank, to both, to none, masked, out of range; a NaN scale."""
        n, fp8 = sum(sizes), self.spec.payload is PayloadFormat.FP8_E4M3
        x = torch.randn(n, H, generator=self.gen)
        idx = torch.randint(-1, E, (n, K), generator=self.gen, dtype=torch.int32)
        fixed = [[1, 3], [E + 2, 0], [2, -5], [0, -1], [3, 3], [-1, -1]]
        if n:
            idx[:min(n, 6)] = torch.tensor(fixed[:n], dtype=torch.int32)
        sf = torch.rand(n, H // 128, generator=self.gen) + 0.5 if fp8 else None
        if fp8 and n:
            sf[0, 0] = float("nan")  # row 0 is local to every consumer: its scale is read, masked, counted
        return Batch(x.to(torch.float8_e4m3fn if fp8 else torch.bfloat16), sf, idx,
                     torch.rand(n, K, generator=self.gen), sizes)

    def publish_all(self, src: int, batch: Batch) -> list[tuple]:
        chunks = []
        for base, m, eos in batch.chunks():
            rows = slice(base, base + m)
            publish_chunk(self.rings[src], x=batch.x[rows], x_sf=None if batch.sf is None else batch.sf[rows],
                          topk_idx=batch.idx[rows], topk_weights=batch.w[rows], token_base=base, end_of_stream=eos)
            chunks.append((base, m, eos, self.expected.publish(src, batch, base, m, eos)))
        return chunks

    def pull(self, rank: int) -> None:
        """schedule._launch_pull's launch."""
        self.arrivals.zero_()  # as the layer does before every pull
        arrivals = self.arrivals if self.grid > 1 else None
        self.library.launch("moe_pull", desc=self.rings[rank].desc, arrivals=arrivals, stage=self.stages[rank].desc,
                            grid=self.grid, block=PULL_BLOCK, stream=None, trace=None, trace_capacity=0)

    def call(self, sizes: list[list[int]]) -> None:
        """One call: every source publishes its chunks and every rank pulls, concurrently; the reference follows."""
        batches = [self.batch(s) for s in sizes]
        published = [self.publish_all(src, b) for src, b in enumerate(batches)]
        for rank in range(len(self.rings)):
            for name in ("idx", "held"):  # the layer refills both before every pull
                getattr(self.stages[rank], name).fill_(-1)
                getattr(self.expected, f"stage_{name}" if name == "idx" else name)[rank].fill_(-1)
            self.pull(rank)
        self.streams.run()
        for dest, stage in enumerate(self.stages):
            for src, chunks in enumerate(published):
                for base, m, eos, seq in chunks:
                    self.expected.pull(dest, src, batches[src], base, m, seq, held=eos)
                self.masked[dest] += masked_inputs(batches[src], stage)

    def ack_held(self) -> None:
        """moe_ack_held as the layer launches it, the combine push's arrivals all in."""
        pushed = torch.full((1,), 3, dtype=torch.int64)
        for rank, (ring, stage) in enumerate(zip(self.rings, self.stages, strict=True)):
            self.library.launch("moe_ack_held", desc=ring.desc, stage=stage.desc, pushed=pushed, push_blocks=3,
                                grid=len(self.rings), block=32, stream=None, trace=None, trace_capacity=0)
            for src, seq in enumerate(self.expected.held[rank].tolist()):
                if seq >= 0:
                    self.expected.ack(rank, src, seq)
        self.streams.run()


def masked_inputs(batch: Batch, stage: Stage) -> int:
    """Values a pull masks and counts: out-of-range expert ids, and non-finite scales of its local rows."""
    bad = (batch.idx < -1) | (batch.idx >= E)
    count = int(bad.sum())
    if batch.sf is not None:
        idx = batch.idx.masked_fill(bad, -1)
        mine = ((idx >= stage.expert_lo) & (idx < stage.expert_hi)).any(dim=1)
        count += int((~torch.isfinite(batch.sf[mine])).sum())
    return count


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
@pytest.mark.parametrize("grid", [1, 3])
def test_one_rank_pulls_its_own_chunks_while_the_ring_wraps(monkeypatch, payload, grid):
    w = World(monkeypatch, 1, payload, grid=grid)
    w.call([[4, 3, 4, 1]])  # at and below tokens_per_slot; 4 chunks through 2 slots
    # A lap-1 publish needs the pull's ack of lap 0: one side waited for the other (which one: the seeded order).
    assert any(site in wait for wait in w.streams.waits_seen for site in ("kWaitReusable", "kWaitRoute"))
    w.expected.check(w.masked)
    w.ack_held()
    w.expected.check(w.masked)


@pytest.mark.parametrize("seed", [0, 1])
def test_two_ranks_pull_each_other_and_a_second_call_continues_the_laps(monkeypatch, seed):
    w = World(monkeypatch, 2, PayloadFormat.FP8_E4M3, seed=seed, grid=2)
    w.call([[4, 2, 3], [1]])
    w.expected.check(w.masked)
    w.ack_held()
    w.call([[3], [4, 4, 2]])
    w.ack_held()
    w.expected.check(w.masked)


def test_an_empty_source_sends_one_empty_chunk_and_stalls_nobody(monkeypatch):
    w = World(monkeypatch, 2, PayloadFormat.BF16, grid=1)
    w.call([[0], [3, 4]])
    w.ack_held()
    w.expected.check(w.masked)


def test_the_split_publish_of_a_large_chunk_lands_alike(monkeypatch):
    monkeypatch.setattr(chunkring.ring.io, "PUBLISH_BYTES_PER_BLOCK", 256)  # 2 rows a block: open, copy x2, close
    w = World(monkeypatch, 1, PayloadFormat.FP8_E4M3, grid=2)
    w.call([[4, 3, 2]])
    assert {name for name, *_ in w.library.launches} >= {"ring_publish_open", "ring_publish_copy",
                                                          "ring_publish_close"}
    w.ack_held()
    w.expected.check(w.masked)


def early_ack_pull(ring, a, part, parts):
    """Mutant: the pull acknowledges each chunk before it reads it (finish_chunk, then the visit)."""
    def acked_first(ring_, s, src, seq, slot, part_, parts_):
        pull_emu.finish_chunk(ring_, ring_.epoch(), src, seq, a.arrivals, parts_)
        return pull_emu.pull_visit(ring_, s, src, seq, slot, part_, parts_)

    yield from pull_emu.moe_pull(ring, a, part, parts, visit=acked_first)


def test_a_pull_that_acknowledges_before_it_reads_is_caught(monkeypatch):
    w = World(monkeypatch, 1, PayloadFormat.FP8_E4M3, mutants={"moe_pull": early_ack_pull})
    with pytest.raises(EmulatedMemoryError, match="outside its wait_chunk"):
        w.call([[4, 2]])


def unwaited_publish(ring, a, part, parts):
    """Mutant: ring_publish_tensors without begin_chunk's wait for the slot's acknowledgements."""
    def no_wait(ring_, epoch, seq):
        yield from ()
        return True

    yield from pull_emu.ring_publish_tensors(ring, a, part, parts, begin=no_wait)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_publish_that_does_not_wait_for_the_acks_is_caught(monkeypatch, seed):
    w = World(monkeypatch, 1, PayloadFormat.FP8_E4M3, seed=seed, mutants={"ring_publish_tensors": unwaited_publish})
    with pytest.raises(EmulatedMemoryError, match="before every destination acknowledged"):
        w.call([[4, 2, 3]])


def test_a_pull_whose_stream_never_ends_waits(monkeypatch):
    w = World(monkeypatch, 1, PayloadFormat.FP8_E4M3)
    batch = w.batch([2])
    publish_chunk(w.rings[0], x=batch.x, x_sf=batch.sf, topk_idx=batch.idx, topk_weights=batch.w, token_base=0,
                  end_of_stream=False)
    w.pull(0)
    with pytest.raises(EmulatedWaitBlocks, match="kWaitRoute"):
        w.streams.run()
