"""The harness of the ring emulation tests (tests/unit/test_ring_pull_emulation.py, test_ring_abort_emulation.py):
W ranks' real :class:`chunkring.Ring` objects over a stand-in runtime per rank and one symmetric heap, their stages,
``chunkring.ring.io``'s library seam pointed at the emulated kernels (tests/helpers/emulation/pull.py), publishes and
pulls launched as the host launches them, and the reference (pull_reference.py) kept alongside."""

from __future__ import annotations

import torch

import chunkring.ring.io
from chunkring import PayloadFormat, Ring, RingSpec
from chunkring.moe._engine.experts import DevicePlan
from chunkring.moe._engine.kernel_args import LocalRouteArgs, LocalScatterArgs
from chunkring.moe._engine.resources import PULL_BLOCK
from chunkring.moe._engine.stage import Stage
from chunkring.moe.gemm import GROUP_ALIGN
from chunkring.ring.io import publish_chunk
from tests.helpers.emulation import local_plan
from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation.machine import Memory
from tests.helpers.emulation.pull_reference import SENTINEL, Batch, Expected
from tests.helpers.emulation.ring import Clock, HeapRuntime, StreamLibrary, Streams, SymmetricHeap

__all__ = ["World", "masked_inputs"]

S, T, H, K, E, N = 2, 4, 128, 2, 4, 12  # slots, tokens per slot, hidden, topk, experts, stage rows per source
PLAN_ROWS = 3 * 128  # a one-rank plan's rows: its two local experts' groups and a group's worth past them


class World:
    """W ranks' rings and stages on one emulated machine, publish_chunk's library seam pointed at it."""

    def __init__(self, monkeypatch, world: int, payload: PayloadFormat, *, seed: int = 0, grid: int = 1,
                 mutants: dict | None = None, clock: Clock | None = None, transport: str = "auto",
                 unmapped: bool = False, launchers=None) -> None:
        """``clock``: waits time out (ring.py's Clock) and each Ring has a failure word the kernels store into.
        ``transport`` "rma": every peer RMA (this rank too); ``unmapped``: no rank maps another (those peers RMA
        under "auto"). ``launchers(heap)``: more kernels by name, ``launcher(memory, grid, block, args)`` -> blocks."""
        self.heap = heap = SymmetricHeap(world)
        if unmapped:
            heap.unmapped = {(r, pe) for r in range(world) for pe in range(world) if r != pe}
        self.memory, self.clock = Memory(), clock
        self.streams = Streams(self.memory, seed, clock)
        table = {**pull_emu.kernels(heap, self.streams, mutants), **local_plan.kernels(heap, self.streams, seed),
                 **(launchers(heap) if launchers else {})}
        self.library = StreamLibrary(self.memory, table, self.streams, ("ring_host_api.cu", "moe_stream.cu",
                                                                       "moe_experts.cu"))
        monkeypatch.setattr(chunkring.ring.io, "kernel_library", lambda runtime: self.library)
        spec = RingSpec(world_size=world, num_slots=S, tokens_per_slot=T, hidden=H, payload=payload, topk=K,
                        num_experts=E)
        self.rings = [Ring(HeapRuntime(heap, r, host_word=clock is not None), spec, timeout_s=5.0, transport=transport)
                      for r in range(world)]
        assert [list(ring.transports) for ring in self.rings] == [
            [int(transport == "rma" or (r, pe) in heap.unmapped) for pe in range(world)] for r in range(world)]
        self.stages = [self.stage(spec, r) for r in range(world)]
        for r, ring in enumerate(self.rings):
            self.memory.add(ring.buffer, f"PE {r} ring")
            if clock is not None:
                self.memory.add(ring.failure.host, f"PE {r} failure word")
        self.grid, self.gen, self.spec = grid, torch.Generator().manual_seed(seed), spec
        self.expected = Expected(self.rings, self.stages, E)
        self.masked = [0] * world
        # Each rank's LayerResources.arrivals of the mode, zeroed once: a call leaves every count at zero.
        self.arrivals = torch.zeros((world, world, S), dtype=torch.int32)

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
        arrivals = self.arrivals[rank] if self.grid > 1 else None
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
        assert not self.arrivals.any(), "a call leaves every arrival count at zero (its chunks' last arrivals)"
        for dest, stage in enumerate(self.stages):
            for src, chunks in enumerate(published):
                for base, m, eos, seq in chunks:
                    self.expected.pull(dest, src, batches[src], base, m, seq, held=eos)
                self.masked[dest] += masked_inputs(batches[src], stage)

    def plan_local(self, batch: Batch, count: int | None = None) -> DevicePlan:
        """A one-rank call's routing into the stage and its rows into a fresh plan: moe_local_route then
        moe_local_scatter as schedule._plan_local launches them (``count``: a device token count); the reference
        follows for the stage (the routing of the rows below the count, -1 for the call's other rows, the masked
        inputs, a count out of range reported). Returns the plan."""
        n, ring, stage = batch.x.shape[0], self.rings[0], self.stages[0]
        E_local, P = stage.expert_hi - stage.expert_lo, PLAN_ROWS
        H_bytes = batch.x.view(torch.uint8).shape[1]
        counters = torch.empty((2, E_local), dtype=torch.int32)
        # torch.empty's rows as a stale plan leaves them: every source 7, which no kernel may leave on a padding row
        plan = DevicePlan(counts=counters[0], group_end=counters[1], src=torch.full((P,), 7, dtype=torch.int32),
                          token=torch.empty(P, dtype=torch.int32), k=torch.empty(P, dtype=torch.int32),
                          weight=torch.empty(P), rows=torch.empty((P, H_bytes), dtype=torch.uint8),
                          rows_sf=torch.empty((0 if batch.sf is None else H // 128, P)),
                          own_row=torch.empty(N * K, dtype=torch.int32))
        for name in ("counts", "src", "token", "k", "weight", "rows", "rows_sf", "own_row"):
            if getattr(plan, name).numel() and name != "counts":
                self.memory.add(getattr(plan, name), f"plan {name}")
        self.memory.add(counters, "plan counters")
        valid = None if count is None else torch.tensor([count], dtype=torch.int32)
        self.library.launch("moe_local_route", args=LocalRouteArgs(
            desc=ring.desc, stage=stage.desc, topk_idx=batch.idx, topk_weights=batch.w, n_tokens=n,
            valid_tokens=valid, block_m=GROUP_ALIGN, counts=plan.counts, group_end=plan.group_end, row_src=plan.src,
            row_token=plan.token, row_k=plan.k, row_weight=plan.weight, own_row=plan.own_row), grid=1, block=1024,
            stream=None)
        self.streams.run()
        self.library.launch("moe_local_scatter", args=LocalScatterArgs(
            desc=ring.desc, stage=stage.desc, x=batch.x.view(torch.uint8), x_sf=batch.sf, n_tokens=n,
            valid_tokens=valid, block_m=GROUP_ALIGN, group_end=plan.group_end, own_row=plan.own_row, rows=plan.rows,
            rows_sf=plan.rows_sf, sf_stride=P, plan_rows=P, row_src=plan.src), grid=self.grid, block=PULL_BLOCK,
            stream=None)
        self.streams.run()
        rows = n if count is None else min(max(count, 0), n)
        self.expected.stage_routing(0, 0, batch, 0, rows)
        self.expected.stage_idx[0][0, rows:n] = -1
        below = Batch(batch.x[:rows], None if batch.sf is None else batch.sf[:rows], batch.idx[:rows],
                      batch.w[:rows], [rows])
        self.masked[0] += masked_inputs(below, stage) + int(count is not None and count != rows)
        return plan

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
