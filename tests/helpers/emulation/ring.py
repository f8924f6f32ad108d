"""The ring's protocol run on the CPU (tests/helpers/emulation/pull.py runs the publish kernels and moe_pull on it):
ranks' symmetric heaps in one process, kernels as coroutines interleaved by a scheduler, and the device functions of
protocol/ring.cuh, publish.cuh, validate.cuh, transport.cuh and status.cuh reduced to what one block does in
sequence, line by line, on the ring words named by the RingDesc (read word by word in ring_desc.cuh's order).

Heap: :class:`HeapRuntime` is a stand-in runtime per rank over one :class:`SymmetricHeap`: the i-th allocation of
every rank is one symmetric object, and ``peer_address`` (the host's nvshmem_ptr) maps an address of this rank's
to the same place of a peer's (0 for a pair in ``SymmetricHeap.unmapped``: that peer is RMA). The kernels' nvshmem_ptr,
remote SETs and swaps go through the same mapping; an RMA peer's gets and the combine puts through rma.py.

Concurrency: each block of each launch is a generator. A spin_until poll whose condition holds returns at once;
one that does not yields, and :class:`Streams` runs other blocks (kernels on other streams, other blocks of the
grid; a stream's launches in order) before polling again. A pass over every waiting block in which nothing
progressed (no poll succeeded, no block started or ended) is a deadlock: :class:`EmulatedWaitBlocks` naming every
wait, where the GPU would spin until its watchdog. Acquire/release loads and fences are plain loads here (one
block runs at a time, between its waits). Blocks resume in an order drawn from ``seed``.

Visibility (the consumer's C1 edge): a block may read a source's slot (meta, x, x_sf, topk_idx, topk_weights)
only between its wait_chunk for that slot and its arrival on or acknowledgement of the chunk (a held chunk stays
readable); any other read raises :class:`EmulatedMemoryError` (the producer's side, pull.py's check_free: a
slot is written only once every destination acknowledged its previous lap). Where it cannot be faithful: memory ordering
itself, timing, lanes inside a block (warps only where rma.py orders operations).

Aborts (status.cuh raise_abort) reach every rank's words through the heap (:class:`HeapRank`): the notice by a
signal SET; each rank's abort word only by its own local CAS (adopting a notice, or its own error); a fetching
operation to a PE in ``SymmetricHeap.fetch_hangs`` never returns (:class:`EmulatedStuck`: the block then waits for
ever). Timeouts, with a :class:`Clock` on the Streams: the
globaltimer stands still while any block progresses and, when every block waits, jumps just past the earliest
deadline of a wait, so exactly the wait with the soonest deadline times out (deterministically); without one, a
pass without progress is EmulatedWaitBlocks. A HeapRuntime with ``host_word`` gives each Ring a failure word the
emulated kernels store into (register ``ring.failure.host`` with the Memory)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import torch

from tests.helpers.emulation.library import EmulatedLibrary
from tests.helpers.emulation.machine import EmulatedMemoryError, Memory, Pointer, header_enum
from tests.helpers.emulation.rma import RmaBlock
from tests.helpers.emulation.waves import STATUS, EmulatedWaitBlocks, Rank

__all__ = ["CONTROL", "Clock", "EmulatedStuck", "HeapRank", "HeapRuntime", "RingView", "Streams", "StreamLibrary",
           "SymmetricHeap", "make_gen"]

CONTROL = header_enum("chunkring/layout/ring_desc.cuh", "ControlWord")
INPUT = header_enum("chunkring/protocol/validate.cuh", "InputField")
META_WORDS, META_EOS = 4, 1


class SymmetricHeap:
    """Every rank's symmetric allocations: an allocation is collective, so the i-th of any rank makes the i-th
    object at every rank (the first rank to reach it allocates it for all)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.objects: list[list[torch.Tensor]] = []  # per object, its tensor at each rank
        self.allocated = [0] * world_size
        self.fetch_hangs: set[int] = set()  # PEs whose fetching remote operations from another PE never return
        self.unmapped: set[tuple[int, int]] = set()  # (my_pe, pe): nvshmem_ptr null, the peer RMA under "auto"

    def alloc(self, rank: int, shape, dtype) -> torch.Tensor:
        i = self.allocated[rank]
        self.allocated[rank] += 1
        if i == len(self.objects):
            self.objects.append([torch.zeros(shape, dtype=dtype) for _ in range(self.world_size)])
        return self.objects[i][rank]

    def nvshmem_ptr(self, address: int, my_pe: int, pe: int) -> int:
        """``address`` (in ``my_pe``'s heap) at ``pe``; 0 outside the heap, as nvshmem_ptr's null."""
        for tensors in self.objects:
            t = tensors[my_pe]
            offset = address - t.data_ptr()
            if 0 <= offset < t.numel() * t.element_size():
                return tensors[pe].data_ptr() + offset
        return 0


class HeapRuntime:
    """A :class:`chunkring.Runtime` stand-in for rank ``rank`` of ``heap`` in one process: host collectives are
    this rank's answer for every rank (every rank passes the same arguments here), quiesce has nothing to wait
    for, and peer_address maps through the heap (every peer DIRECT)."""

    def __init__(self, heap: SymmetricHeap, rank: int, *, host_word: bool = False) -> None:
        self.heap, self.rank, self.world_size, self.host_word = heap, rank, heap.world_size, host_word
        self.torch_device = torch.device("cpu")

    def alloc(self, shape, dtype):
        return self.heap.alloc(self.rank, shape, dtype)

    def free(self, tensor):
        pass

    def mapped_host_word(self):
        """The failure word: a CPU int64 and, with ``host_word``, its address as the device's (else 0: unwritten)."""
        word = torch.zeros(1, dtype=torch.int64)
        return word, word.data_ptr() if self.host_word else 0

    def peer_address(self, tensor, pe):
        return 0 if (self.rank, pe) in self.heap.unmapped else self.heap.nvshmem_ptr(tensor.data_ptr(), self.rank, pe)

    def allgather_object(self, obj, *, timeout_s=None):
        return [obj] * self.world_size

    def abandon_barrier(self):
        pass

    def quiesce(self, timeout_s, *, what):
        pass

    def synchronize(self, timeout_s, *, what):
        pass  # the emulated kernels ran in Streams.run


class EmulatedStuck(Exception):  # noqa: N818 - a block's state, as EmulatedWaitBlocks
    """A fetching remote operation that never returns: the block raising it waits for ever."""

    def forever(self):
        while True:
            yield str(self)


class Clock:
    """The globaltimer in ns: ``now``, and the deadlines the waits of the current pass hold."""

    def __init__(self) -> None:
        self.now, self.deadlines = 0, set()

    def wake(self) -> bool:
        """Every block waits: jump just past the earliest deadline (False: no wait has one)."""
        later = [t for t in self.deadlines if t >= self.now]
        self.deadlines.clear()
        if not later:
            return False
        self.now = min(later) + 1
        return True


class HeapRank(Rank):
    """A Rank whose aborts reach every rank's words through the heap (status.cuh raise_abort)."""

    def __init__(self, memory: Memory, desc, heap: SymmetricHeap) -> None:
        super().__init__(memory, desc)
        self.heap = heap

    def status_word(self, name: str, pe: int) -> Pointer:
        """Status word ``name`` of PE ``pe`` (nvshmem_ptr of this rank's)."""
        address = self.heap.nvshmem_ptr(self.status.address + 8 * STATUS[name], self.d.my_pe, pe)
        return Pointer(self.memory, address, f"{name} at PE {pe}")

    def signal_set(self, name: str, word: int, pe: int) -> None:
        """A non-fetching atomic SET (an atomic store: a CAS from what the word holds)."""
        target = self.status_word(name, pe)
        target.cas_as(np.uint64, 0, target.load_as(np.uint64, 0, name), word, name)

    def fetching_cas(self, name: str, compare: int, word: int, pe: int) -> int:
        """A fetching CAS on PE ``pe``'s word: it returns once ``pe`` answers - never, for a PE in the heap's
        fetch_hangs. No kernel of ours issues one; the tests' mutants do, to show what it would cost."""
        if pe != self.d.my_pe and pe in self.heap.fetch_hangs:
            raise EmulatedStuck(f"PE {self.d.my_pe} waits for ever for PE {pe}'s answer to its CAS of {name}")
        return int(self.status_word(name, pe).cas_as(np.uint64, 0, compare, word, name))

    def raise_abort(self, word: int) -> None:
        """This rank's abort word (a landed notice adopted, else ``word``: local CASes), then the notice at every
        rank by non-fetching SETs through the heap (quiet: nothing). No fetching operation on a peer."""
        if not self.abort_word():
            self.status_word("kStatusAbort", self.d.my_pe).cas_as(np.uint64, 0, 0, word, "kStatusAbort")
        for pe in range(self.d.world_size):
            self.signal_set("kStatusAbortNotice", word, pe)


class Streams:
    """CUDA streams of launches, each launch a list of block generators; :meth:`run` interleaves them."""

    def __init__(self, memory: Memory, seed: int = 0, clock: Clock | None = None) -> None:
        self.memory, self.rng, self.progress, self.clock = memory, np.random.default_rng(seed), 0, clock
        self.queues: dict[object, deque] = {}
        self.waits_seen: list[str] = []  # every wait that yielded, in order

    def enqueue(self, stream, blocks: list) -> None:
        self.queues.setdefault(stream, deque()).append([blocks, None])

    def run(self) -> None:
        """Until every stream is empty. A pass visits the streams in a seeded order; each runs its launches until one
        waits (a stream runs ahead as far as it can). A pass without progress moves the clock to the next deadline;
        where there is none (or no clock), it raises EmulatedWaitBlocks."""
        while any(self.queues.values()):
            before, waits = self.progress, []
            if self.clock is not None:
                self.clock.deadlines.clear()
            queues = [q for q in self.queues.values() if q]
            for i in self.rng.permutation(len(queues)):
                while queues[i]:
                    waiting = self.step(queues[i][0])
                    waits += waiting
                    if waiting:
                        break
                    queues[i].popleft()
            self.waits_seen += waits
            if self.progress == before and not (self.clock is not None and self.clock.wake()):
                raise EmulatedWaitBlocks("every block waits: " + "; ".join(waits))

    def step(self, launch: list) -> list[str]:
        """Every unfinished block of ``launch`` once, in a seeded order, until it waits or ends: their waits."""
        if launch[1] is None:  # a launch starts when it reaches the head of its stream
            launch[1], self.progress = self.memory.begin_launch(), self.progress + 1
        blocks, waiting = launch[0], []
        for i in self.rng.permutation(len(blocks)):
            self.memory.switch(launch[1])
            try:
                waiting.append(next(blocks[i]))
            except StopIteration:
                blocks[i], self.progress = None, self.progress + 1
            except EmulatedStuck as stuck:  # it acted (its stores stand), then waits for ever
                blocks[i], self.progress = stuck.forever(), self.progress + 1
                waiting.append(str(stuck))
        launch[0] = [b for b in blocks if b is not None]
        return waiting


class StreamLibrary(EmulatedLibrary):
    """An EmulatedLibrary whose launches are enqueued on :class:`Streams` (run by :meth:`Streams.run`): the publish
    kernels of a ring descriptor on its producer stream, any other kernel on a stream of its own name and desc.
    ``kernels[name](memory, grid, block, args)`` returns the launch's block generators."""

    def __init__(self, memory: Memory, kernels: dict, streams: Streams, sources=("ring_host_api.cu", "moe_stream.cu")):
        super().__init__(memory, kernels, sources, initialised=lambda tensor: True)
        self.streams = streams

    def launch(self, name, /, *, grid=1, block, stream=None, shared_bytes=0, pdl=False, **args) -> None:
        values = self.arguments(name, args)
        self.launches.append((name, grid, block, args))
        kind = "publish" if name.startswith("ring_publish") else name  # and the ring: its desc, loose or a field
        self.streams.enqueue((kind, values.desc.base), self.kernels[name](self.memory, int(grid), int(block), values))


def make_gen(epoch: int, lap: int, bits: int) -> int:
    return (epoch << (64 - bits)) | ((lap + 1) & (2**64 - 1) >> bits)


def classify_gen(observed: int, expected: int, bits: int) -> str:
    """rules.cuh classify_gen (the ack words' classify_acked is the same test)."""
    if observed == expected:
        return "ready"
    if observed == 0:
        return "not yet"
    if observed >> (64 - bits) != expected >> (64 - bits):
        return "stale"
    mask = (2**64 - 1) >> bits
    return "not yet" if observed & mask < expected & mask else "ahead"


class RingView:
    """One block's view of its rank's ring: the descriptor's addresses, loads and stores by address, the
    protocol's waits (generators) and the slots this block may read now (``visible``)."""

    def __init__(self, memory: Memory, heap: SymmetricHeap, streams: Streams, desc, block: int) -> None:
        self.memory, self.heap, self.streams, self.block = memory, heap, streams, block
        self.rank = HeapRank(memory, desc, heap)
        self.rank.clock = streams.clock
        self.d = self.rank.d
        self.visible: set[tuple[int, int]] = set()
        self.rma = RmaBlock(memory, self.d.my_pe)  # a block of PULL_BLOCK threads: 8 warps

    # --- addresses (layout/ring_desc.cuh) and words
    def part(self, name: str, slot: int) -> int:
        """slot_x / slot_x_sf / slot_topk_idx / slot_topk_weights / slot_meta: byte address."""
        d = self.d
        row = {"x": d.x_row_bytes, "x_sf": 4 * d.x_sf_row_floats, "topk_idx": 4 * d.topk,
               "topk_weights": 4 * d.topk}
        per_slot = META_WORDS * 8 if name == "meta" else d.tokens_per_slot * row[name]
        return d.base + getattr(d, f"off_{name}") + slot * per_slot

    def word(self, region: str, index: int) -> int:
        """Byte address of u64 ``index`` of region ``region`` (route_ready / ack rows flattened by the caller)."""
        return self.d.base + getattr(self.d, f"off_{region}") + 8 * index

    def ready_word(self, kind: str, src: int, slot: int) -> int:
        return self.word(f"{kind}_ready", src * self.d.ready_row_words + slot)

    def ack_word(self, slot: int, dest: int) -> int:
        return self.word("ack", slot * self.d.ack_slot_words + dest)

    def load(self, address: int, what: str) -> int:
        return int(Pointer(self.memory, address, what).load_as(np.uint64, 0, what))

    def store(self, address: int, value: int, what: str) -> None:
        Pointer(self.memory, address, what).store_as(np.uint64, 0, value % 2**64, what)

    def ordered_store(self, address: int, dtype, value: int, what: str) -> None:
        """A word one launch stores repeatedly, each store ordered after the last by the protocol (a cursor, an
        arrival count): exempt from the one-store rule as atomics are (a CAS from what it holds)."""
        ptr = Pointer(self.memory, address, what)
        ptr.cas_as(dtype, 0, ptr.load_as(dtype, 0, what), value, what)

    def remote(self, address: int, pe: int) -> int:
        """nvshmem_ptr / a remote op's target: this rank's symmetric ``address`` at ``pe``."""
        return self.heap.nvshmem_ptr(address, self.d.my_pe, pe)

    def epoch(self) -> int:
        return self.load(self.word("control", CONTROL["kControlEpoch"]), "epoch")

    def gen(self, epoch: int, seq: int) -> int:
        return make_gen(epoch, seq // self.d.num_slots, self.d.epoch_bits)

    def has_error(self) -> bool:
        return self.rank.word("kStatusCode") != 0

    # --- status.cuh / validate.cuh
    def record_error(self, code: str, site: str, peer: int, slot: int, expected: int, observed: int) -> None:
        self.rank.record_error(code, site, peer, slot, expected, observed)

    def report_input(self, field: str, source: int, slot: int, row: int, column: int, value: int) -> None:
        status = self.rank.status
        status.atomic_add_as(np.uint64, STATUS["kStatusInputCount"], 1, "input count")
        if status.cas_as(np.uint64, STATUS["kStatusInputField"], 0, INPUT[field], "input field") != 0:
            return
        for name, v in (("Source", source), ("Slot", slot), ("Row", row), ("Column", column), ("Value", value)):
            status.store_as(np.uint64, STATUS[f"kStatusInput{name}"], v % 2**64, f"input {name}")

    def spin_until(self, site: str, peer: int, slot: int, expected: int, poll):
        """spin_until (generator): :meth:`Rank.spin_until`, a poll that decides counted as progress."""
        def counted():
            verdict, observed = poll()
            if verdict != 0:
                self.streams.progress += 1
            return verdict, observed

        return (yield from self.rank.spin_until(site, peer, slot, expected, counted, f" block {self.block}"))

    def poll_gen(self, address: int, site: str, peer: int, slot: int, want: int):
        """A poll of a generation word (ready or ack) for spin_until, with poll_verdict's error records."""
        def poll():
            observed = self.load(address, site)
            state = classify_gen(observed, want, self.d.epoch_bits)
            if state in ("ready", "not yet"):
                return int(state == "ready"), observed
            code = "kStaleEpoch" if state == "stale" else "kGenerationAhead"
            self.record_error(code, site, peer, slot, want, observed)
            return -1, observed
        return poll

    # --- consumer reads (transport.cuh, DIRECT): only of a slot this block waited for
    def check_visible(self, address: int, nbytes: int, src: int) -> None:
        for name in ("x", "x_sf", "topk_idx", "topk_weights", "meta"):
            first, second = self.part(name, 0), self.part(name, 1)
            end = first + (second - first) * self.d.num_slots
            if first <= address < end and second > first:
                slot = (address - first) // (second - first)
                if address + nbytes > first + (second - first) * (slot + 1):
                    raise EmulatedMemoryError(f"a read of {src}'s slot {slot} {name} runs past the slot")
                if (src, slot) not in self.visible:
                    raise EmulatedMemoryError(f"PE {self.d.my_pe} block {self.block} reads {name} of source {src}'s "
                                              f"slot {slot} outside its wait_chunk .. acknowledgement")
                return

    def fetch(self, dst: int, part: int, nbytes: int, src: int, what: str, warp: int | None = None) -> None:
        """fetch_block (``warp`` None) / fetch_warp: nothing for zero bytes; an RMA source's bytes by a get (rma.py),
        a DIRECT one's from nvshmem_ptr(part, src) into dst, 16 bytes at a time where copy16_ok, else 4."""
        if nbytes == 0:
            return
        self.check_visible(part, nbytes, src)
        if self.d.rma_peers >> src & 1:
            at = self.remote(part, src)  # the symmetric address a get names
            if warp is None:
                return self.rma.get_now(dst, at, nbytes, what)
            return self.rma.get_nbi(dst, at, nbytes, warp, what, lambda: self.check_visible(part, nbytes, src))
        view = 0 if (self.d.my_pe, src) in self.heap.unmapped else self.remote(part, src)
        if view == 0:
            raise EmulatedMemoryError(f"{what}: no mapping of source {src}'s slot (a DIRECT peer must have one)")
        copy(self.memory, dst, view, nbytes, what)

    def fetch_meta(self, src: int, slot: int) -> SimpleNamespace | None:
        """Three blocking get_u64 (RMA) or loads through nvshmem_ptr (None: DIRECT without a mapping)."""
        meta = self.part("meta", slot)
        self.check_visible(meta, 3 * 8, src)
        rma = self.d.rma_peers >> src & 1
        view = 0 if not rma and (self.d.my_pe, src) in self.heap.unmapped else self.remote(meta, src)
        if view == 0:
            return None
        words = Pointer(self.memory, view, "meta").load_as(np.uint64, np.arange(3), "slot meta")
        return SimpleNamespace(token_base=int(words[0]), num_tokens=int(words[1]), flags=int(words[2]))

    def chunk_meta(self, src: int, slot: int) -> SimpleNamespace | None:
        meta = self.fetch_meta(src, slot)
        if meta is None:
            self.record_error("kPeerUnreachable", "kPayload", src, slot, 0, 0)
        return meta


def copy(memory: Memory, dst: int, src: int, nbytes: int, what: str, unit: int | None = None) -> None:
    """block_copy16 / warp_copy16 (``unit`` 16) or block_copy4 (4); None: 16 where copy16_ok, else 4."""
    unit = unit or (16 if (dst | src | nbytes) % 16 == 0 else 4)
    assert nbytes % unit == 0, f"{what}: {nbytes} bytes is no multiple of 4"
    offsets = np.arange(nbytes // unit, dtype=np.int64) * unit
    data = Pointer(memory, src, what).load(offsets, unit, what)
    Pointer(memory, dst, what).store(offsets, data, what)
