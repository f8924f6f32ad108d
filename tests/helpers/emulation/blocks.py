"""The pull into incremental expert blocks and the waves beside it, run on the CPU as written (tests/unit/
test_moe_blocks_emulation.py drives them): moe_pull_blocks of device/kernels/moe_stream.cu with moe/blocks.cuh's
reserve_row (RESERVE, ALLOCATE or WAIT), land_row (LAND, SEAL A FULL BLOCK) and end_of_streams (the finisher's
partial seals), on ring.py's heap and streams and pull.py's consumer walk (consume_invocation, chunk and scale
checks, held acks); waves.py's moe_wave_claim, its wait yielding to the pull; and moe_drain (ring.cuh drain:
poll_acked of every chunk still possibly unacknowledged). The StageDesc and PoolDesc are read word by word in
layout/moe_desc.cuh's order.

:class:`WaveStreamLibrary` puts each launch on the stream the layer puts it: the publish kernels on their ring's
producer stream, moe_pull_blocks on the pull stream, everything else (claim, gather, decode GEMMs, combine push,
moe_ack_held, moe_drain) on the stream :attr:`WaveStreamLibrary.stream` names when it is launched (the layer's
consumer or producer stream). Kernels that never wait (the gather, the decode emulator's) run as one step.

Interleaving: besides their waits, a pull block yields between a block's RESERVE of row 0 and its ALLOCATE (so other
blocks' reservations of that block WAIT) and after each LAND, and the claim after each pool id it looks at, so the
claim scans while rows land and blocks seal (the real concurrency of the waves path). Lanes and warps of one
block run in sequence: a block's rows in order, each row's choices in k order (lane 0's own order on the GPU).
Where it cannot be faithful: memory ordering (the fences and acquire/release pairs are plain accesses here), the
timeline trace, RMA peers, timeouts."""

from __future__ import annotations

import numpy as np

from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation import waves as waves_emu
from tests.helpers.emulation.machine import Pointer, read_struct
from tests.helpers.emulation.plan import STRUCTS, moe_plan_reset
from tests.helpers.emulation.ring import RingView, StreamLibrary
from tests.helpers.emulation.waves import DESC_FIELD, SEALED_BIT, PoolWords

__all__ = ["NO_ROW", "WaveStreamLibrary", "kernels"]

NO_ROW = 2**32 - 1  # blocks::kNoRow


def preempt(ring: RingView):
    """A point where other blocks may run: progress made, so not a wait."""
    ring.streams.progress += 1
    yield f"PE {ring.d.my_pe} block {ring.block} runs on"


def check_pool(ring: RingView, s, p) -> bool:
    """moe::check_pool with the stage: the wave's checks, then the experts against the stage's range."""
    if not ring.rank.check_pool(p):
        return False
    experts = s.expert_hi - s.expert_lo
    if experts != p.experts:
        ring.record_error("kInternal", "kDescriptor", 0, DESC_FIELD["kFieldExperts"], experts, p.experts)
        return False
    return True


def reserve_row(ring: RingView, pool: PoolWords, e: int, seal_on_reserve: bool = False):
    """blocks::reserve_row (generator): the pool row, or NO_ROW after an overflow or a failed wait."""
    L = pool.layout
    r = pool.atomic_add(L.reserve(e), 1, "reserve")
    j, offset = divmod(r, L.block_m)
    if j >= L.blocks_per_expert:
        ring.record_error("kInternal", "kBlocks", e, j, L.blocks_per_expert, r)
        return NO_ROW
    if offset == 0:
        yield from preempt(ring)  # other lanes may reserve the block's later rows before it is allocated
        i = pool.atomic_add(L.counter("kPoolNext"), 1, "pool_next")
        if i >= L.blocks:
            ring.record_error("kInternal", "kBlocks", e, i, L.blocks, i)
            return NO_ROW
        pool.store(L.expert_of(i), e, "expert_of")  # the label before the id is published
        pool.store(L.block_of(e, j), i + 1, "block_of")
    else:
        def poll():
            published = pool.load(L.block_of(e, j), "block_of")
            return int(published != 0), published

        if not (yield from ring.spin_until("kWaitAllocation", ring.d.my_pe, e, 1, poll)):
            return NO_ROW
        i = (pool.load(L.block_of(e, j), "block_of") - 1) % 2**32
        if i >= L.blocks:
            return NO_ROW
    if seal_on_reserve and offset == L.block_m - 1:  # the kSealOnReserve mutant
        pool.store(L.state(i), SEALED_BIT | L.block_m, "state")
        pool.atomic_add(L.counter("kSealed"), 1, "sealed")
    return i * L.block_m + offset


def land_row(pool: PoolWords, row: int, seal_on_reserve: bool = False) -> None:
    """blocks::land_row: LAND, and SEAL the block if this row completed it."""
    L = pool.layout
    i = row // L.block_m
    old = pool.atomic_add(L.landed(i), 1, "landed")
    if not seal_on_reserve and old + 1 == L.block_m:
        pool.store(L.state(i), SEALED_BIT | L.block_m, "state")
        pool.atomic_add(L.counter("kSealed"), 1, "sealed")


def end_of_streams(ring: RingView, pool: PoolWords, parts: int) -> None:
    """blocks::end_of_streams (thread 0): arrive on kEnded; the last block seals every partial block."""
    L = pool.layout
    if pool.atomic_add(L.counter("kEnded"), 1, "ended") + 1 != parts:
        return
    for e in range(L.experts):
        c = min(pool.load(L.reserve(e), "reserve"), L.blocks_per_expert * L.block_m)
        n = c % L.block_m
        if n == 0:
            continue
        i = (pool.load(L.block_of(e, c // L.block_m), "block_of") - 1) % 2**32
        if i >= L.blocks:
            continue
        landed = pool.load(L.landed(i), "landed")
        if landed != n:
            ring.record_error("kInternal", "kBlocks", e, i, n, landed)
        pool.store(L.state(i), SEALED_BIT | n, "state")
        pool.atomic_add(L.counter("kSealed"), 1, "sealed")
    pool.store(L.counter("kSealedAll"), 1, "sealed_all")


def chunk_rows(ring: RingView, s, src: int, slot: int, meta, next_base: list[int]) -> tuple[int, int]:
    """checked_chunk_rows and checked_chunk_order of the chunk's ``meta``: (token_base, rows)."""
    base, n = pull_emu.checked_chunk_rows(ring, s, src, slot, meta, ring.block == 0)
    if n and base < next_base[src]:
        if ring.block == 0:
            ring.report_input("kTokenBase", src, slot, 0, next_base[src], base)
        n = 0
    return base, n


def pull_blocks_visit(ring: RingView, s, p, src: int, slot: int, meta, part: int, parts: int, next_base: list[int],
                      seal_on_reserve: bool):
    """moe_pull_blocks' visit for block ``part`` of ``parts`` (generator: reservations may wait)."""
    (base, n), d, K, N = chunk_rows(ring, s, src, slot, meta, next_base), ring.d, ring.d.topk, s.token_capacity
    lo, hi = n * part // parts, n * (part + 1) // parts
    first_row = src * N + (base if n else 0)
    at = Pointer(ring.memory, p.pos + 4 * first_row * K, "pool pos")
    idx = pull_emu.fetch_choices(ring, s, src, slot, first_row, lo, hi)
    if n:
        next_base[src] = base + n
    pool, row_bytes, sf = PoolWords(ring.memory, p), d.x_row_bytes, d.x_sf_row_floats
    for row in range(lo, hi):  # pass 1: lane 0 reserves in k order, the warp fetches
        for k in range(K):
            e = int(idx.load_as(np.int32, row * K + k, "stage idx"))
            local = s.expert_lo <= e < s.expert_hi
            q = (yield from reserve_row(ring, pool, e - s.expert_lo, seal_on_reserve)) if local else NO_ROW
            at.store_as(np.uint32, row * K + k, q, "pos")
        for k in range(K):
            q, warp = int(at.load_as(np.uint32, row * K + k, "pos")), (row - lo) % ring.rma.warps
            if q != NO_ROW:
                ring.fetch(p.x + q * row_bytes, ring.part("x", slot) + row * row_bytes, row_bytes, src, "x", warp)
                ring.fetch(p.sf + 4 * q * sf, ring.part("x_sf", slot) + 4 * row * sf, 4 * sf, src, "sf", warp)
    ring.rma.fetch_done(bool(d.rma_peers >> src & 1))
    for row in range(lo, hi):  # pass 2: scales checked in place, src / token / k / weight stored, then LAND
        for k in range(K):
            q = int(at.load_as(np.uint32, row * K + k, "pos"))
            if q == NO_ROW:
                continue
            pull_emu.checked_scales(ring, p.sf + 4 * q * sf, src, slot, row, "pool sf")
            weight = Pointer(ring.memory, s.w, "stage w").load_as(np.float32, (first_row + row) * K + k, "stage w")
            for field, dtype, value in (("src", np.int32, src), ("token", np.int32, base + row),
                                        ("k", np.int32, k), ("weight", np.float32, weight)):
                Pointer(ring.memory, getattr(p, field), f"pool {field}").store_as(dtype, q, value, f"pool {field}")
            land_row(pool, q, seal_on_reserve)
            yield from preempt(ring)
    return True


def moe_pull_blocks(ring: RingView, a, part: int, parts: int, seal_on_reserve: bool = False, defer: bool = True):
    assert a.trace is None, "the timeline trace is not emulated"
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    p = read_struct(a.pool_desc, STRUCTS["PoolDesc"], "PoolDesc")
    if not ring.rank.check_descriptor() or not pull_emu.check_stage(ring, s) or not check_pool(ring, s, p):
        return
    next_base = [0] * ring.d.world_size  # __shared__, one per block: every block masks the same chunks

    def visit(src: int, seq: int, slot: int, meta):
        return pull_blocks_visit(ring, s, p, src, slot, meta, part, parts, next_base, seal_on_reserve)

    held = Pointer(ring.memory, s.held, "held") if defer else None  # held_acks (None: the kNoDeferredAck mutant)
    # A block whose walk failed (recorded) never arrives on kEnded.
    if (yield from pull_emu.consume_invocation(ring, ring.epoch(), a.arrivals, parts, held, visit)):
        end_of_streams(ring, PoolWords(ring.memory, p), parts)


def moe_pull_blocks_sealing_on_reserve(ring: RingView, a, part: int, parts: int):
    """The kSealOnReserve mutant (protocol/mutants.cuh): a block's last reservation seals it, LAND never does."""
    yield from moe_pull_blocks(ring, a, part, parts, seal_on_reserve=True)


def moe_pull_blocks_acking_every_chunk(ring: RingView, a, part: int, parts: int):
    """The kNoDeferredAck mutant: each source's last chunk acknowledged by the pull too, not held."""
    yield from moe_pull_blocks(ring, a, part, parts, defer=False)


def moe_wave_claim(ring: RingView, a, part: int, parts: int):
    """waves.py's moe_wave_claim with its wait yielding to the pull, and the pull running while it scans (a
    preemption before each pool id; the ids in an order drawn from the streams' seed)."""
    def order(n: int) -> list[int]:
        return ring.streams.rng.permutation(n).tolist()

    yield from waves_emu.moe_wave_claim(ring.memory, ring.rank, a, ring.spin_until, order, lambda: preempt(ring))


def moe_drain(ring: RingView, a, part: int, parts: int):
    """ring.cuh drain (thread 0): poll_acked of every chunk of the last num_slots this rank published."""
    if not ring.rank.check_descriptor():
        return
    epoch, nxt = ring.epoch(), pull_emu.next_seq(ring)
    for seq in range(max(nxt - ring.d.num_slots, 0), nxt):
        if not (yield from pull_emu.poll_acked(ring, epoch, seq)):
            return


class WaveStreamLibrary(StreamLibrary):
    """A StreamLibrary with the layer's streams: publishes on ("publish", desc), moe_pull_blocks on ("pull", desc),
    any other launch on :attr:`stream` (set by the caller, as the layer's ``torch.cuda.stream`` blocks do). A
    kernel of ``plain`` (``fn(memory, grid, block, shared_bytes, args)``, which never waits) runs as one step."""

    SOURCES = ("ring_host_api.cu", "moe_stream.cu", "moe_experts.cu", "moe_decode.cu")

    def __init__(self, memory, coroutines: dict, plain: dict, streams) -> None:
        super().__init__(memory, coroutines, streams, self.SOURCES)
        self.plain, self.stream = plain, "consumer"

    def launch(self, name, /, *, grid=1, block, stream=None, shared_bytes=0, pdl=False, **args) -> None:
        if name not in self.plain:
            if name.startswith("ring_publish") or name == "moe_pull_blocks":
                return super().launch(name, grid=grid, block=block, stream=stream, shared_bytes=shared_bytes,
                                      **args)
            return self.enqueue(name, grid, block, args, self.kernels[name](self.memory, int(grid), int(block),
                                                                            self.arguments(name, args)))
        values = self.arguments(name, args)
        kernel = self.plain[name]

        def once():
            kernel(self.memory, int(grid), int(block), int(shared_bytes), values)
            yield from ()

        self.enqueue(name, grid, block, args, [once()])

    def enqueue(self, name, grid, block, args, blocks) -> None:
        self.launches.append((name, grid, block, args))
        self.streams.enqueue(self.stream, blocks)


def kernels(heap, streams, mutants: dict | None = None) -> dict:
    """The coroutine kernels by name (pull.py's publishes and moe_ack_held, and this module's), each launch's
    blocks with their own RingView; ``mutants`` replace some by name."""
    return pull_emu.kernels(heap, streams, {"moe_pull_blocks": moe_pull_blocks, "moe_wave_claim": moe_wave_claim,
                                            "moe_drain": moe_drain, **(mutants or {})})


def plain_kernels(order_seed: int, decode: dict, claimed: list) -> dict:
    """The kernels that never wait: the call's reset, the plan's reset, the wave's gather, and ``decode``
    (decode.py's kernels). Each gather first appends (its PoolDesc's words address, the pool ids its wave claimed,
    sealed_all then) to ``claimed``."""
    def gather(memory, grid, block, shared_bytes, a):
        pool = PoolWords(memory, read_struct(a.pool_desc, STRUCTS["PoolDesc"], "PoolDesc"))
        count, at = pool.load(pool.layout.counter("kWaveCount"), "wave_count"), pool.layout.wave_ids()
        claimed.append((pool.words.address, [pool.load(at + i, "wave_ids") for i in range(count)],
                        pool.load(pool.layout.counter("kSealedAll"), "sealed_all")))
        waves_emu.moe_wave_gather(memory, grid, block, shared_bytes, a, order_seed=order_seed)

    return {"moe_wave_gather": gather, "moe_call_reset": pull_emu.moe_call_reset,
            "moe_plan_reset": moe_plan_reset, **decode}
