"""One wave of incremental expert blocks run on the CPU as written (tests/unit/test_moe_wave_emulation.py drives
it): moe_wave_claim and moe_wave_gather of device/kernels/moe_experts.cu on moe/blocks.cuh's pool words, with the
protocol functions the claim calls - check_descriptor, moe/descriptors.cuh's check_pool, spin_until, record_error
(protocol/status.cuh) - reduced to what one thread does in sequence on this rank's own memory. The ring descriptor
and the PoolDesc are read word by word in the order their headers declare; the error record lands in the ring
buffer's status words, as on the GPU.

spin_until: the claim is a coroutine whose wait yields (blocks.py runs it beside the pull); :func:`kernels` runs it
alone, so nothing changes a word while a wait polls it. A wait whose condition holds at its first poll returns at
once; one that would keep polling returns false where the GPU's would stop at its 64th poll (this rank has an error;
a peer's abort word or notice - recorded as kPeerAborted), and otherwise yields, which run alone raises
:class:`EmulatedWaitBlocks`: on the GPU it waits for another kernel (the pull), or times out.
raise_abort reaches this rank's own abort words; the other ranks' (other GPUs) are listed in ``aborts_sent``
(ring.py's HeapRank writes them through the symmetric heap instead).

The claim's threads scan the pool ids in an order drawn from ``order_seed`` (its CAS and atomics then run in that
order), the gather's warps likewise. Where it cannot be faithful: memory ordering (acquire loads, fences - the
claim's and the gather's reads of the pull's rows are ordinary loads here), timing and timeouts, and anything the
pull running concurrently would change."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.helpers.emulation.decode import group_offsets
from tests.helpers.emulation.machine import (
    WARP,
    EmulatedMemoryError,
    Pointer,
    header_constant,
    header_enum,
    header_structs,
    read_struct,
)
from tests.helpers.emulation.plan import (
    LAYOUT_VERSION,
    STRUCTS,
    descriptor,
    moe_plan_reset,
    pointer,
    store_group_end,
    store_plan_row,
)

__all__ = ["ERROR", "SITE", "STATUS", "EmulatedWaitBlocks", "PoolLayout", "kernels", "sealed_unclaimed"]

RING_FIELDS = header_structs("chunkring/layout/ring_desc.cuh")["RingDesc"]
RING_VERSION = header_constant("chunkring/layout/ring_desc.cuh", "kRingLayoutVersion")
STATUS = header_enum("chunkring/layout/ring_desc.cuh", "StatusWord")
CONTROL = header_enum("chunkring/layout/ring_desc.cuh", "ControlWord")
ERROR = header_enum("chunkring/protocol/status.cuh", "ErrorCode")
SITE = header_enum("chunkring/protocol/status.cuh", "Site")
COUNTER = header_enum("chunkring/moe/blocks.cuh", "Counter")
DESC_FIELD = header_enum("chunkring/moe/descriptors.cuh", "DescField")  # what check_stage / check_pool record
# moe/blocks.cuh's state bits.
SEALED_BIT, CLAIMED_BIT = 1 << 30, 1 << 31
COUNT_MASK = SEALED_BIT - 1
ABORT_CODE_BITS = ABORT_ORIGIN_BITS = 8


class EmulatedWaitBlocks(AssertionError):
    """A spin_until that would keep waiting: on the GPU, for another kernel's progress (or its timeout)."""


def sealed_unclaimed(sealed: int, claimed: int) -> int:
    """blocks::sealed_unclaimed: a count behind the claims means none."""
    return sealed - claimed if sealed > claimed else 0


@dataclass(frozen=True)
class PoolLayout:
    """blocks::Pool: the u32 word index of each counter and array (the host's pull model uses it too)."""

    experts: int
    blocks_per_expert: int
    blocks: int
    block_m: int

    def counter(self, name: str) -> int:
        return COUNTER[name]

    def reserve(self, e: int) -> int:
        return COUNTER["kHeader"] + e

    def block_of(self, e: int, j: int) -> int:
        return COUNTER["kHeader"] + self.experts + e * self.blocks_per_expert + j

    def landed(self, i: int) -> int:
        return COUNTER["kHeader"] + self.experts * (1 + self.blocks_per_expert) + i

    def state(self, i: int) -> int:
        return self.landed(i) + self.blocks

    def expert_of(self, i: int) -> int:
        return self.landed(i) + 2 * self.blocks

    def wave_ids(self) -> int:
        return self.landed(0) + 3 * self.blocks


class Rank:
    """This rank's protocol state through its ring descriptor: the status and control words of its ring buffer."""

    def __init__(self, memory, desc) -> None:
        self.d = read_struct(desc, RING_FIELDS, "RingDesc")
        self.status = Pointer(memory, self.d.base + self.d.off_status, "status words")
        self.control = Pointer(memory, self.d.base + self.d.off_control, "control words")
        self.memory, self.aborts_sent = memory, []
        self.clock = None  # ring.py's Clock (the globaltimer) where waits time out; None: they never do

    def word(self, name: str) -> int:
        return int(self.status.load_as(np.uint64, STATUS[name], name))

    def record_error(self, code: str, site: str, peer: int, slot: int, expected: int, observed: int) -> None:
        """record_error: the first record of the launch claims the status words; then the host word and the abort."""
        d = self.d
        self.status.atomic_add_as(np.uint64, STATUS["kStatusCount"], 1, "status count")
        if self.status.cas_as(np.uint64, STATUS["kStatusCode"], 0, ERROR[code], "status code") != 0:
            return
        for name, value in (("kStatusPe", d.my_pe), ("kStatusPeer", peer), ("kStatusSlot", slot),
                            ("kStatusExpected", expected), ("kStatusObserved", observed), ("kStatusSite", SITE[site])):
            self.status.store_as(np.uint64, STATUS[name], value % 2**64, name)
        if code == "kBadDescriptor":
            return
        if code == "kPeerAborted":
            self.report_to_host(observed)
            return
        epoch = int(self.control.load_as(np.uint64, CONTROL["kControlEpoch"], "epoch"))
        word = epoch << (ABORT_CODE_BITS + ABORT_ORIGIN_BITS) | d.my_pe << ABORT_CODE_BITS | ERROR[code]
        self.report_to_host(word)
        self.raise_abort(word)

    def abort_word(self) -> int:
        """abort_word: this rank's abort word, a landed notice adopted into it by a local CAS from 0."""
        adopted = self.word("kStatusAbort")
        if adopted:
            return adopted
        notice = self.word("kStatusAbortNotice")
        if not notice:
            return 0
        held = int(self.status.cas_as(np.uint64, STATUS["kStatusAbort"], 0, notice, "abort word"))
        return held or notice

    def raise_abort(self, word: int) -> None:
        """raise_abort: this rank's abort word (a landed notice adopted, else ``word``: local CASes), then the notice
        at every rank - this rank's own here (a signal SET is an atomic store: a CAS from what it holds), the others'
        listed. No fetching operation on a peer."""
        if not self.abort_word():
            self.status.cas_as(np.uint64, STATUS["kStatusAbort"], 0, word, "abort word")
        for pe in range(self.d.world_size):
            if pe == self.d.my_pe:
                notice = self.word("kStatusAbortNotice")
                self.status.cas_as(np.uint64, STATUS["kStatusAbortNotice"], notice, word, "abort notice")
            else:
                self.aborts_sent.append((pe, word))

    def report_to_host(self, word: int) -> None:
        if self.d.failure_word != 0:
            Pointer(self.memory, self.d.failure_word, "failure word").store_as(np.uint64, 0, word, "failure word")

    def spin_until(self, site: str, peer: int, slot: int, expected: int, poll, who: str = ""):
        """spin_until (a generator): poll's verdict, or false where the GPU's 64th poll stops at an error (this
        rank's, or a peer's abort recorded as kPeerAborted); while it would keep polling it yields what it waits
        for (``who``: the block, where several run). With a ``clock`` it also gives up once the clock is past the
        deadline (entry + the descriptor's timeout_ns), recording kTimeout, as the GPU's 64th poll does."""
        clock = self.clock
        deadline = None if clock is None else clock.now + self.d.timeout_ns
        while True:
            verdict, observed = poll()
            if verdict != 0:
                return verdict > 0
            if self.word("kStatusCode") != 0:
                return False
            abort = self.abort_word()
            if abort:
                self.record_error("kPeerAborted", site, peer, slot, expected, abort)
                return False
            if deadline is not None:
                if clock.now > deadline:
                    self.record_error("kTimeout", site, peer, slot, expected, observed)
                    return False
                clock.deadlines.add(deadline)
            yield f"PE {self.d.my_pe}{who} at {site} would wait (peer {peer}, slot {slot}): " \
                  f"expected {expected:#x}, observed {observed:#x}"

    def check_descriptor(self) -> bool:
        d = self.d
        if d.layout_version == RING_VERSION and d.desc_bytes == 8 * len(RING_FIELDS):
            return True
        self.record_error("kBadDescriptor", "kDescriptor", 0, 0, RING_VERSION, d.layout_version)  # thread 0
        return False

    def check_pool(self, p) -> bool:
        """moe::check_pool without a stage: DescCheck records the first field that differs (thread 0)."""
        expectations = (("kFieldVersion", LAYOUT_VERSION, p.layout_version),
                        ("kFieldBytes", 8 * len(STRUCTS["PoolDesc"]), p.desc_bytes),
                        ("kFieldRowBytes", self.d.x_row_bytes, p.row_bytes),
                        ("kFieldSfPerRow", self.d.x_sf_row_floats, p.sf_per_row))
        for field, expected, observed in expectations:
            if expected != observed:
                self.record_error("kInternal", "kDescriptor", 0, DESC_FIELD[field], expected, observed)
                return False
        return True


class PoolWords:
    """pool_of(PoolDesc): the words through their address, u32 loads, stores and atomics by word index."""

    def __init__(self, memory, p) -> None:
        self.layout = PoolLayout(p.experts, p.blocks_per_expert, p.blocks, p.block_m)
        self.words = pointer(memory, p, "words")

    def load(self, i: int, what: str) -> int:
        return int(self.words.load_as(np.uint32, i, what))

    def store(self, i: int, value: int, what: str) -> None:
        self.words.store_as(np.uint32, i, value % 2**32, what)

    def atomic_add(self, i: int, value: int, what: str) -> int:
        return int(self.words.atomic_add_as(np.uint32, i, value, what))

    def cas(self, i: int, compare: int, value: int, what: str) -> int:
        return int(self.words.cas_as(np.uint32, i, compare, value, what))


def run_alone(coroutine):
    """Run a kernel's coroutine with nothing beside it: a wait it would yield at raises :class:`EmulatedWaitBlocks`
    (nothing here could satisfy it; on the GPU another kernel - the pull - would, or the wait times out)."""
    try:
        waiting = next(coroutine)
    except StopIteration as end:
        return end.value
    raise EmulatedWaitBlocks(waiting)


def no_preemption():
    yield from ()


def wait_for_blocks(pool: PoolWords, claimed: int, want: int, last: bool, spin_until, pe: int):
    """moe_wave_claim's wait (thread 0; a generator, as ``spin_until``)."""
    L = pool.layout

    def poll():
        if pool.load(L.counter("kSealedAll"), "sealed_all") != 0:
            return 1, 0
        if last:
            return 0, 0
        observed = sealed_unclaimed(pool.load(L.counter("kSealed"), "sealed"), claimed)
        return (1 if observed >= want else 0), observed

    return (yield from spin_until("kWaitBlocks", pe, 0, want, poll))


def moe_wave_claim(memory, rank: Rank, a, spin_until, order, preempt=no_preemption):
    """moe_wave_claim as a coroutine: ``spin_until`` its wait (a generator: :meth:`Rank.spin_until`, or a ring
    view's that yields to other kernels), ``order(n)`` the order its threads scan the pool ids ``0..n``,
    ``preempt()`` a point before each id where other blocks may run."""
    if not rank.check_descriptor():
        return
    p = read_struct(a.pool_desc, STRUCTS["PoolDesc"], "PoolDesc")
    if not rank.check_pool(p):
        return
    pool = PoolWords(memory, p)
    L = pool.layout
    # thread 0
    claimed = pool.load(L.counter("kClaimed"), "claimed")
    want = 1 if a.last else a.min_blocks % 2**32
    ready = yield from wait_for_blocks(pool, claimed, want, bool(a.last), spin_until, rank.d.my_pe)
    allocated = min(pool.load(L.counter("kPoolNext"), "pool_next"), L.blocks)
    claimed_here = 0
    pool.store(L.counter("kWaveCount"), 0, "wave_count")
    # __syncthreads()
    if not ready:
        return
    for i in order(allocated):  # id = threadIdx.x; id += blockDim.x
        yield from preempt()
        state = pool.load(L.state(i), "state")
        if not state & SEALED_BIT or state & CLAIMED_BIT:
            continue
        n = state & COUNT_MASK
        if pool.cas(L.state(i), state, CLAIMED_BIT | n, "state") != state:
            continue
        landed = pool.load(L.landed(i), "landed")
        if landed != n:
            rank.record_error("kInternal", "kBlocks", rank.d.my_pe, i, n, landed)
        pool.store(L.wave_ids() + pool.atomic_add(L.counter("kWaveCount"), 1, "wave_count"), i, "wave_ids")
        a.counts.atomic_add_as(np.uint32, pool.load(L.expert_of(i), "expert_of"), n, "counts")
        claimed_here += 1
    # __syncthreads(); thread 0
    claimed = pool.load(L.counter("kClaimed"), "claimed") + claimed_here
    pool.store(L.counter("kClaimed"), claimed, "claimed")
    if a.last and claimed != allocated:
        rank.record_error("kInternal", "kBlocks", rank.d.my_pe, 0, allocated, claimed)


def moe_wave_claim_alone(memory, grid, block, shared_bytes, a, order_seed: int = 0, ranks: list | None = None):
    """The claim run alone (:func:`run_alone`): its threads scan in an order drawn from ``order_seed``."""
    rank = Rank(memory, a.desc)
    if ranks is not None:
        ranks.append(rank)

    def order(n: int) -> list[int]:
        return np.random.default_rng(order_seed).permutation(n).tolist()

    run_alone(moe_wave_claim(memory, rank, a, rank.spin_until, order))


def moe_wave_gather(memory, grid, block, shared_bytes, a, order_seed: int = 0) -> None:
    pd = descriptor(memory, a.pool_desc, "PoolDesc")  # require_descriptor
    pool = PoolWords(memory, pd)
    L = pool.layout
    num_local, block_m = L.experts, L.block_m
    pool_x, pool_sf = pointer(memory, pd, "x"), pointer(memory, pd, "sf")
    pool_src, pool_token = pointer(memory, pd, "src"), pointer(memory, pd, "token")
    pool_k, pool_w = pointer(memory, pd, "k"), pointer(memory, pd, "weight")
    row_bytes, sf_per_row = pd.row_bytes, pd.sf_per_row
    offsets = group_offsets(a.counts, num_local, block_m, block, shared_bytes)
    store_group_end(a, offsets, num_local)
    claimed, bm = pool.load(L.counter("kWaveCount"), "wave_count"), block_m
    warps = grid * block // WARP
    items = [item for warp in range(warps) for item in range(warp, claimed * bm, warps)]
    for item in np.random.default_rng(order_seed).permutation(items):
        item = int(item)
        i = pool.load(L.wave_ids() + item // bm, "wave_ids")
        n, src_row = pool.load(L.state(i), "state") & COUNT_MASK, i * bm + item % bm
        if item % bm >= n:
            continue
        e = pool.load(L.expert_of(i), "expert_of")
        if e >= num_local:
            raise EmulatedMemoryError(f"offsets[{e}]: past the {num_local + 1} shared words")
        p = offsets[e] + int(a.cursors.atomic_add_as(np.uint32, e, 1, "cursors"))  # lane 0, then __shfl_sync
        fields = (pool_src.load_as(np.int32, src_row, "pool src"), pool_token.load_as(np.int32, src_row, "pool token"),
                  pool_k.load_as(np.int32, src_row, "pool k"), pool_w.load_as(np.float32, src_row, "pool weight"))
        store_plan_row(a, p, fields, pool_x, pool_sf, src_row, row_bytes, sf_per_row, "pool")


def kernels(order_seed: int = 0, ranks: list | None = None) -> dict:
    """The emulated wave kernels by name; each claim's :class:`Rank` (its ``aborts_sent``) is appended to
    ``ranks``."""
    return {"moe_plan_reset": moe_plan_reset,
            "moe_wave_claim": lambda *args: moe_wave_claim_alone(*args, order_seed=order_seed, ranks=ranks),
            "moe_wave_gather": lambda *args: moe_wave_gather(*args, order_seed=order_seed)}
