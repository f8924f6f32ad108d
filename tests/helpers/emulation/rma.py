"""NVSHMEM's RMA operations as protocol/transport.cuh and comm/rma.cuh use them, for the CPU emulation (ring.py's
RingView.fetch / fetch_meta take this path for a peer whose bit is set in RingDesc.rma_peers), and moe_combine_push's
RMA branch (moe_experts.cu) run as written on it.

Completion: a blocking get (get_u64, get_block: fetch_meta, fetch_block) copies at once. A non-blocking one
(get_warp_nbi: fetch_warp) or put (put_block_nbi: put_block) is *pending*: a get's destination bytes are
uninitialised (a read raises EmulatedMemoryError) and a put's target bytes at the peer too, until a quiet completes
it - then the get reads its source (still inside its wait_chunk .. ack window, checked again) and the put stores the
bytes its source held at the issue (a source changed before the quiet is an error). nvshmem_quiet completes every
operation of the calling PE issued before it (docs/PROTOCOL.md "Transports"); issued before means ordered before,
and the model grants only what the code orders: the quieting warp's own earlier operations, and the block's
operations of an earlier barrier interval (RmaBlock.barrier). Another warp's operation of the quiet's own interval
is taken as issued after it, and another block's operations as unordered with it (nothing orders them), so they
stay pending. A block put is issued as one piece per warp (each thread's part of nvshmemx_putmem_nbi_block).

Mutants (RmaBlock flags, set by a mutant kernel): ``quiet_in_put_done`` False - put_done without its quiet;
``barrier_before_quiet`` False - quiet_block without the barrier before thread 0's quiet."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tests.helpers.emulation.decode import RING_FIELDS, group_offsets, weighted
from tests.helpers.emulation.machine import WARP, EmulatedMemoryError, Memory, Pointer, read_struct

__all__ = ["RmaBlock", "combine_push_launcher"]


@dataclass
class Op:
    warp: int
    phase: int
    complete: Callable[[], None]


def invalidate(memory: Memory, address: int, nbytes: int, what: str) -> None:
    """Bytes an operation in flight will write: unreadable until it completes."""
    alloc, at = memory.at(address, what)
    if at + nbytes > alloc.raw.size:
        raise EmulatedMemoryError(f"{what}: {nbytes} bytes run past {alloc.name}")
    alloc.valid[at:at + nbytes] = False


def read_bytes(memory: Memory, address: int, nbytes: int, what: str) -> np.ndarray:
    return Pointer(memory, address, what).load(np.arange(nbytes), 1, what)[:, 0].copy()


def write_bytes(memory: Memory, address: int, data: np.ndarray, what: str) -> None:
    Pointer(memory, address, what).store(np.arange(data.size), data[:, None], what)


class RmaBlock:
    """One block's RMA operations at PE ``my_pe``: issue, barriers, quiet."""

    def __init__(self, memory: Memory, my_pe: int, warps: int = 8) -> None:
        self.memory, self.my_pe, self.warps = memory, my_pe, warps
        self.phase, self.pending = 0, []
        self.barrier_before_quiet = self.quiet_in_put_done = True

    def barrier(self) -> None:
        """__syncthreads: every operation issued before it is ordered before what follows it."""
        self.phase += 1

    def get_now(self, dst: int, src: int, nbytes: int, what: str) -> None:
        """A blocking get (``src``: the source's address, the symmetric counterpart at its PE)."""
        write_bytes(self.memory, dst, read_bytes(self.memory, src, nbytes, what), what)

    def get_nbi(self, dst: int, src: int, nbytes: int, warp: int, what: str, check: Callable[[], None]) -> None:
        """get_warp_nbi by ``warp``: ``dst`` unreadable until a quiet completes it (``check`` then: the source may
        still be read)."""
        invalidate(self.memory, dst, nbytes, what)

        def complete():
            check()
            write_bytes(self.memory, dst, read_bytes(self.memory, src, nbytes, what), what)

        self.pending.append(Op(warp, self.phase, complete))

    def put_nbi(self, dst: int, src: int, nbytes: int, what: str) -> None:
        """put_block_nbi: each warp's part (``dst`` at the peer) unwritten - and unreadable - until completed."""
        cuts = [nbytes * w // self.warps // 4 * 4 for w in range(self.warps)] + [nbytes]
        for w, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
            if hi > lo:
                self.put_piece(dst + lo, src + lo, hi - lo, w, what)

    def put_piece(self, dst: int, src: int, nbytes: int, warp: int, what: str) -> None:
        data = read_bytes(self.memory, src, nbytes, what)
        invalidate(self.memory, dst, nbytes, what)

        def complete():
            alloc, at = self.memory.at(src, what)
            if not np.array_equal(alloc.raw[at:at + nbytes], data):
                raise EmulatedMemoryError(f"{what}: the put's source changed before the quiet completed it")
            write_bytes(self.memory, dst, data, what)

        self.pending.append(Op(warp, self.phase, complete))

    def quiet(self, warp: int = 0) -> None:
        """nvshmem_quiet by a thread of ``warp``: completes what is ordered before it (the module's rule)."""
        done = [op for op in self.pending if op.phase < self.phase or op.warp == warp]
        self.pending = [op for op in self.pending if op not in done]
        for op in done:
            op.complete()

    def quiet_block(self, quiets: bool = True) -> None:
        """transport.cuh quiet_block: a barrier, thread 0 quiets, a barrier."""
        if self.barrier_before_quiet:
            self.barrier()
        if quiets:
            self.quiet(0)
        self.barrier()

    def fetch_done(self, rma: bool) -> None:
        if rma:
            self.quiet_block()
        else:
            self.barrier()

    def put_block(self, dst: int, src: int, nbytes: int, what: str) -> None:
        self.barrier()  # every thread's stores to the row before any thread's part of the put reads it
        self.put_nbi(dst, src, nbytes, what)

    def put_done(self) -> None:
        self.quiet_block(self.quiet_in_put_done)


def combine_push_block(memory: Memory, heap, a, block_idx: int, grid: int, block: int, rb: RmaBlock):
    """moe_combine_push for block ``block_idx`` (a generator: it never waits)."""
    d = read_struct(a.desc, RING_FIELDS, "RingDesc") if a.desc is not None else None
    offsets = group_offsets(a.counts, a.num_local, a.block_m, block, 4 * (a.num_local + 1))
    used, H = offsets[a.num_local], a.hidden
    i = np.arange(0, H, 8)  # thread x takes i = 8x, 8x + 8 blockDim, ...: every i once
    for row in range(block_idx, used, grid):
        src = int(a.row_src.load_as(np.int32, row, "row_src"))
        if src < 0 or src == a.own_rank:
            continue
        rma = d is not None and bool(d.rma_peers >> src & 1)
        w = np.float32(a.row_weight.load_as(np.float32, row, "row_weight"))
        token = int(a.row_token.load_as(np.int32, row, "row_token")) % 2**64
        at = (token * a.topk + int(a.row_k.load_as(np.int32, row, "row_k"))) * H
        v = a.out.load((row * H + i) * 2, 16, "out row").view(np.uint16)
        r = weighted(v, w).reshape(len(i), 16)
        if rma:
            a.out.store((row * H + i) * 2, r, "out row, weighted in place")
            target = heap.nvshmem_ptr(a.combine.base + 2 * at, d.my_pe, src)  # combine + at, symmetric, on src
            rb.put_block(target, a.out.base + 2 * row * H, 2 * H, f"combine row put to PE {src}")
        else:
            peer, to = memory.at(int(a.peer_combine.load_as(np.uint64, src, "peer_combine")), "peer_combine[src]")
            peer.store(to + (at + i) * 2, r, "combine row")
    if d is not None and d.rma_peers != 0:
        rb.put_done()
    rb.barrier()
    a.pushed.atomic_add_as(np.uint64, 0, 1, "pushed")  # thread 0, after its system-scope fence
    yield from ()


def combine_push_launcher(heap, mutate: Callable[[RmaBlock], None] | None = None) -> Callable:
    """moe_combine_push for a StreamLibrary (``launcher(memory, grid, block, args)``: the launch's blocks); the
    combine buffers are symmetric objects of ``heap``. ``mutate``: applied to every block's RmaBlock (a mutant)."""
    def launch(memory, grid, block, a):
        blocks = []
        for b in range(grid):
            my_pe = read_struct(a.desc, RING_FIELDS, "RingDesc").my_pe if a.desc is not None else 0
            rb = RmaBlock(memory, my_pe, block // WARP)
            if mutate is not None:
                mutate(rb)
            blocks.append(combine_push_block(memory, heap, a, b, grid, block, rb))
        return blocks

    return launch
