"""The ring's data path of device/kernels/ring_host_api.cu (ring_publish_tensors; ring_publish_open, _copy, _close;
ring_raise_abort) and moe_stream.cu (moe_call_reset, moe_pull, moe_ack_held; moe_local_route and moe_local_scatter:
local_plan.py) run on the CPU as written, over tests/helpers/emulation/ring.py's heap, streams and protocol words
(tests/unit/test_ring_pull_emulation.py drives them through publish_chunk and the layer's launches,
test_ring_abort_emulation.py the aborts). Each
function mirrors its device function (protocol/ring.cuh begin_chunk, poll_acked, publish, end_chunk, wait_chunk,
ack_chunk, finish_chunk, last_block_to_arrive, consume_invocation; publish.cuh chunk_extent, close_chunk;
validate.cuh's checks; moe/descriptors.cuh check_stage) for one block, thread 0's part
where the device has thread 0 alone act; the StageDesc is read word by word in layout/moe_desc.cuh's order and its
addresses resolved where dereferenced. An RMA source's fetches are rma.py's gets, completed by fetch_done's quiet.
Not emulated: the timeline trace (the launches pass trace=None)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.helpers.emulation.machine import EmulatedMemoryError, Pointer, read_struct
from tests.helpers.emulation.plan import LAYOUT_VERSION, STRUCTS, descriptor
from tests.helpers.emulation.ring import CONTROL, META_EOS, RingView, copy, make_gen
from tests.helpers.emulation.waves import DESC_FIELD, ERROR

__all__ = ["NO_HELD_CHUNK", "check_stage", "checked_chunk_rows", "checked_expert", "checked_scale", "chunk_extent",
           "kernels", "moe_call_reset"]

NO_HELD_CHUNK = 2**64 - 1  # moe_stream.cu kNoHeldChunk


# ---------------------------------------------------------------- producer
def next_seq(ring: RingView) -> int:
    return ring.load(ring.word("control", CONTROL["kControlNextSeq"]), "next_seq")


def poll_acked(ring: RingView, epoch: int, seq: int):
    """ring.cuh poll_acked; its caller's acquire fence (acquire_acks) has no counterpart in this sequentially
    consistent emulation."""
    slot, gen = seq % ring.d.num_slots, ring.gen(epoch, seq)
    for dest in range(ring.d.world_size):
        word = ring.ack_word(slot, dest)
        if not (yield from ring.spin_until("kWaitReusable", dest, slot, gen,
                                           ring.poll_gen(word, "kWaitReusable", dest, slot, gen))):
            return False
    return True


def begin_chunk(ring: RingView, epoch: int, seq: int, ordered: bool = False):
    """``ordered``: every block of the launch stores the consumed word (the same value), an ordered store."""
    d = ring.d
    slot, lap, mask = seq % d.num_slots, seq // d.num_slots, (2**64 - 1) >> d.epoch_bits
    if lap >= mask:  # !lap_fits
        ring.record_error("kLapOverflow", "kPublish", d.my_pe, slot, mask - 1, lap)
        return False
    if lap >= 1:
        if not (yield from poll_acked(ring, epoch, seq - d.num_slots)):
            return False
        consumed, gen = ring.word("consumed", slot), ring.gen(epoch, seq - d.num_slots)
        if ordered:
            ring.ordered_store(consumed, np.uint64, gen, "consumed")
        else:
            ring.store(consumed, gen, "consumed")
    return True


def chunk_extent(ring: RingView, a, report: bool) -> SimpleNamespace:
    e = SimpleNamespace(n=a.n_tokens, eos=a.end_of_stream != 0, publish=True)
    if a.valid_tokens is None:
        return e
    asked = int(a.valid_tokens.load_as(np.int32, 0, "valid_tokens"))
    valid = min(max(asked, 0), a.batch_rows)
    if report and asked != valid and a.token_base == 0:
        ring.report_input("kValidTokens", ring.d.my_pe, 0, 0, 0, asked)
    if a.token_base > 0 and a.token_base >= valid:
        return SimpleNamespace(n=0, eos=False, publish=False)
    e.n, e.eos = min(valid - a.token_base, e.n), a.token_base + a.n_tokens >= valid
    return e


def check_free(ring: RingView, epoch: int, seq: int) -> None:
    """The producer's side of the visibility check: a slot is written for chunk ``seq`` only once every destination
    acknowledged its previous lap (begin_chunk's wait, in this kernel or the split publish's open)."""
    d = ring.d
    if seq >= d.num_slots:
        acks = [ring.load(ring.ack_word(seq % d.num_slots, dest), "ack") for dest in range(d.world_size)]
        if acks != [ring.gen(epoch, seq - d.num_slots)] * d.world_size:
            raise EmulatedMemoryError(f"PE {d.my_pe} writes slot {seq % d.num_slots} for chunk {seq} before every "
                                      f"destination acknowledged chunk {seq - d.num_slots} (ack words {acks})")


def copy_rows(ring: RingView, seq: int, a, n: int, part: int, parts: int) -> None:
    """This block's share of the rows: block_copy16 of x, block_copy4 of the rest."""
    d, K, slot = ring.d, ring.d.topk, seq % ring.d.num_slots
    check_free(ring, ring.epoch(), seq)
    lo, hi = n * part // parts, n * (part + 1) // parts
    for name, src, row in (("x", a.x, d.x_row_bytes), ("x_sf", a.x_sf, 4 * d.x_sf_row_floats),
                           ("topk_idx", a.topk_idx, 4 * K), ("topk_weights", a.topk_weights, 4 * K)):
        if (hi - lo) * row:
            copy(ring.memory, ring.part(name, slot) + lo * row, src.base + lo * row, (hi - lo) * row,
                 f"publish {name}", 16 if name == "x" else 4)


def publish(ring: RingView, epoch: int, seq: int, kind: str) -> None:
    """Remote SET of the ready word at every destination (the release fence: nothing to order here)."""
    word = ring.ready_word(kind, ring.d.my_pe, seq % ring.d.num_slots)
    for dest in range(ring.d.world_size):
        ring.store(ring.remote(word, dest), ring.gen(epoch, seq), f"{kind}_ready at PE {dest}")


def close_chunk(ring: RingView, epoch: int, seq: int, e, token_base: int) -> None:
    check_free(ring, epoch, seq)
    meta = ring.part("meta", seq % ring.d.num_slots)
    for i, value in enumerate((token_base, e.n, META_EOS if e.eos else 0)):
        ring.store(meta + 8 * i, value, "meta")
    publish(ring, epoch, seq, "route")
    publish(ring, epoch, seq, "layout")
    ring.store(ring.word("control", CONTROL["kControlNextSeq"]), seq + 1, "next_seq")  # end_chunk


def ring_publish_tensors(ring: RingView, a, part: int, parts: int, begin=begin_chunk):
    if not ring.rank.check_descriptor():
        return
    e = chunk_extent(ring, a, True)
    if not e.publish:
        return
    epoch, seq = ring.epoch(), next_seq(ring)
    if not (yield from begin(ring, epoch, seq)):
        return
    copy_rows(ring, seq, a, e.n, 0, 1)
    close_chunk(ring, epoch, seq, e, a.token_base)


def ring_publish_open(ring: RingView, a, part: int, parts: int):
    if not ring.rank.check_descriptor() or not chunk_extent(ring, a, True).publish:
        return
    yield from begin_chunk(ring, ring.epoch(), next_seq(ring))


def ring_publish_copy(ring: RingView, a, part: int, parts: int):
    if not ring.rank.check_descriptor() or ring.has_error():
        return
    e = chunk_extent(ring, a, False)
    if e.publish:
        copy_rows(ring, next_seq(ring), a, e.n, part, parts)
    yield from ()


def ring_publish_close(ring: RingView, a, part: int, parts: int):
    if not ring.rank.check_descriptor() or ring.has_error():
        return
    e = chunk_extent(ring, a, False)
    if e.publish:
        close_chunk(ring, ring.epoch(), next_seq(ring), e, a.token_base)
    yield from ()


# ---------------------------------------------------------------- consumer
def wait_chunk(ring: RingView, epoch: int, src: int, seq: int):
    slot, want = seq % ring.d.num_slots, ring.gen(epoch, seq)
    for kind, site in (("route", "kWaitRoute"), ("layout", "kWaitLayout")):
        word = ring.ready_word(kind, src, slot)
        if not (yield from ring.spin_until(site, src, slot, want, ring.poll_gen(word, site, src, slot, want))):
            return False
    ring.visible.add((src, slot))  # wait_acquire_fence: the slot's bytes are this block's to read
    return True


def ack_chunk(ring: RingView, epoch: int, src: int, seq: int) -> bool:
    d = ring.d
    slot, gen = seq % d.num_slots, ring.gen(epoch, seq)
    prev = 0 if seq < d.num_slots else make_gen(epoch, seq // d.num_slots - 1, d.epoch_bits)
    ring.visible.discard((src, slot))
    word = Pointer(ring.memory, ring.remote(ring.ack_word(slot, d.my_pe), src), f"ack word at PE {src}")
    replaced = int(word.load_as(np.uint64, 0, "ack"))
    word.cas_as(np.uint64, 0, replaced, gen, "ack")  # the remote swap
    if replaced != prev:
        ring.record_error("kDoubleAck" if replaced == gen else "kAckTagMismatch", "kAck", src, slot, prev, replaced)
        return False
    ring.ordered_store(ring.word("cursor", src), np.uint64, seq + 1, "cursor")
    return True


def finish_chunk(ring: RingView, epoch: int, src: int, seq: int, counts, blocks: int) -> bool:
    if counts is None:
        return ack_chunk(ring, epoch, src, seq)
    ring.visible.discard((src, seq % ring.d.num_slots))  # this block's reads of the chunk end at its arrival
    i = src * ring.d.num_slots + seq % ring.d.num_slots
    if int(counts.atomic_add_as(np.uint32, i, 1, "arrivals")) != blocks - 1:  # last_block_to_arrive
        return True
    counts.cas_as(np.uint32, i, blocks, 0, "arrivals")  # *count = 0: a store after the last atomic
    return ack_chunk(ring, epoch, src, seq)


def consume_invocation(ring: RingView, epoch: int, counts, blocks: int, deferred: Pointer | None, visit):
    """ring.cuh consume_invocation; ``visit(src, seq, slot, meta)`` is a generator (moe_pull_blocks' reservations
    may wait), its value whether the walk goes on; ``meta``: the chunk's meta words, fetched once per step."""
    d = ring.d
    next_seqs = [ring.load(ring.word("cursor", src), "cursor") for src in range(d.world_size)]
    active = set(range(d.world_size))
    while active:
        for src in range(d.world_size):
            if src not in active:
                continue
            seq = next_seqs[src]
            slot = seq % d.num_slots
            if not (yield from wait_chunk(ring, epoch, src, seq)):
                return False
            meta = ring.chunk_meta(src, slot)
            if meta is None:
                return False
            eos = bool(meta.flags & META_EOS)
            if not (yield from visit(src, seq, slot, meta)):
                return False
            if deferred is not None and eos:
                if ring.block == 0:
                    deferred.store_as(np.uint64, src, seq, "held")
            elif not finish_chunk(ring, epoch, src, seq, counts, blocks):
                return False
            next_seqs[src] = seq + 1
            if eos:
                active.discard(src)
    return True


def check_stage(ring: RingView, s) -> bool:
    """moe::check_stage: the first field that differs, recorded (thread 0 of each block)."""
    d = ring.d
    for field, expected, observed in (("kFieldVersion", LAYOUT_VERSION, s.layout_version),
                                      ("kFieldBytes", 8 * len(STRUCTS["StageDesc"]), s.desc_bytes),
                                      ("kFieldSources", d.world_size, s.sources), ("kFieldTopk", d.topk, s.topk),
                                      ("kFieldRowBytes", d.x_row_bytes, s.row_bytes),
                                      ("kFieldSfPerRow", d.x_sf_row_floats, s.sf_per_row)):
        if expected != observed:
            ring.record_error("kInternal", "kDescriptor", 0, DESC_FIELD[field], expected, observed)
            return False
    return True


def checked_chunk_rows(ring: RingView, s, src: int, slot: int, meta, report: bool) -> tuple[int, int]:
    """checked_chunk_rows of the chunk's ``meta`` (consume_invocation's): (token_base, rows), no rows where the meta
    is out of the stage's range (the grid's first thread, ``report``, reports it)."""
    d, N = ring.d, s.token_capacity
    base, n = meta.token_base, meta.num_tokens
    if n > d.tokens_per_slot or base > N or n > N - base:
        if report:
            field, value = ("kNumTokens", n) if n > d.tokens_per_slot else ("kTokenBase", base)
            ring.report_input(field, src, slot, 0, 0, value)
        n = 0
    return base, n


def checked_expert(ring: RingView, src: int, slot: int, row: int, k: int, expert: int) -> int:
    """validate.cuh checked_expert: an expert in [-1, num_experts), or -1 (an out-of-range one reported)."""
    if -1 <= expert < ring.d.num_experts:
        return expert
    ring.report_input("kTopkIdx", src, slot, row, k, expert)
    return -1


def checked_scale(ring: RingView, src: int, slot: int, row: int, column: int, scale: np.float32,
                  report: bool = True) -> np.float32:
    """validate.cuh checked_scale: a finite scale, or 0 (reported, if ``report``)."""
    if np.isfinite(scale):
        return scale
    if report:
        ring.report_input("kXSf", src, slot, row, column, int(np.float32(scale).view(np.uint32)))
    return np.float32(0)


def fetch_choices(ring: RingView, s, src: int, slot: int, first_row: int, lo: int, hi: int) -> Pointer:
    """Rows lo..hi's topk_idx and topk_weights fetched into the stage at ``first_row``, each expert checked in
    place (checked_expert): the stage's idx from ``first_row``."""
    K = ring.d.topk
    idx = Pointer(ring.memory, s.idx + 4 * first_row * K, "stage idx")
    ring.fetch(idx.address + 4 * lo * K, ring.part("topk_idx", slot) + 4 * lo * K, 4 * (hi - lo) * K, src, "idx")
    ring.fetch(s.w + 4 * (first_row + lo) * K, ring.part("topk_weights", slot) + 4 * lo * K, 4 * (hi - lo) * K,
               src, "w")
    for i in range(lo * K, hi * K):
        e = checked_expert(ring, src, slot, i // K, i % K, int(idx.load_as(np.int32, i, "stage idx")))
        idx.store_as(np.int32, i, e, "stage idx", again=True)
    return idx


def checked_scales(ring: RingView, address: int, src: int, slot: int, row: int, what: str) -> None:
    """checked_scale, in place: a row's scale factors at ``address``, each one not finite reported and zeroed."""
    scales = Pointer(ring.memory, address, what)
    for i in range(ring.d.x_sf_row_floats):
        value = checked_scale(ring, src, slot, row, i, scales.load_as(np.float32, i, what))
        scales.store_as(np.float32, i, value, what, again=True)


def pull_visit(ring: RingView, s, src: int, seq: int, slot: int, meta, part: int, parts: int) -> bool:
    """moe_pull's visit for block ``part`` of ``parts``."""
    (base, n), d, N, K = checked_chunk_rows(ring, s, src, slot, meta, part == 0), ring.d, s.token_capacity, ring.d.topk
    lo, hi = n * part // parts, n * (part + 1) // parts
    first_row = src * N + (base if n else 0)
    idx = fetch_choices(ring, s, src, slot, first_row, lo, hi)
    rows = np.arange(lo, hi)
    choices = idx.load_as(np.int32, rows[:, None] * K + np.arange(K), "stage idx").reshape(-1, K)
    mine = rows[((choices >= s.expert_lo) & (choices < s.expert_hi)).any(axis=1)]
    row_bytes, sf = d.x_row_bytes, d.x_sf_row_floats
    for row in mine.tolist():  # a warp per row: rows lo, lo + 8, ... to warp 0
        warp = (row - lo) % ring.rma.warps
        ring.fetch(s.x + (first_row + row) * row_bytes, ring.part("x", slot) + row * row_bytes, row_bytes, src, "x",
                   warp)
        ring.fetch(s.sf + 4 * (first_row + row) * sf, ring.part("x_sf", slot) + 4 * row * sf, 4 * sf, src, "sf",
                   warp)
    ring.rma.fetch_done(bool(d.rma_peers >> src & 1))
    for row in mine.tolist():
        checked_scales(ring, s.sf + 4 * (first_row + row) * sf, src, slot, row, "stage sf")
    return True


def moe_pull(ring: RingView, a, part: int, parts: int, visit=pull_visit):
    assert a.trace is None, "the timeline trace is not emulated"
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    if not ring.rank.check_descriptor() or not check_stage(ring, s):
        return
    held = Pointer(ring.memory, s.held, "held")

    def visit_now(src: int, seq: int, slot: int, meta):  # moe_pull's visit never waits
        yield from ()
        return visit(ring, s, src, seq, slot, meta, part, parts)

    yield from consume_invocation(ring, ring.epoch(), a.arrivals, parts, held, visit_now)


def moe_ack_held(ring: RingView, a, part: int, parts: int):
    """Block ``part`` acknowledges source ``part``'s held chunk once every push block arrived."""
    assert a.trace is None, "the timeline trace is not emulated"
    s = read_struct(a.stage, STRUCTS["StageDesc"], "StageDesc")
    if not ring.rank.check_descriptor() or not check_stage(ring, s):
        return
    seq = int(Pointer(ring.memory, s.held, "held").load_as(np.uint64, part, "held"))
    if seq == NO_HELD_CHUNK:
        return
    want = a.push_blocks % 2**64

    def poll():
        observed = int(a.pushed.load_as(np.uint64, 0, "pushed"))
        return int(observed == want), observed

    if (yield from ring.spin_until("kWaitPushed", ring.d.my_pe, 0, want, poll)):
        ack_chunk(ring, ring.epoch(), part, seq)


def ring_raise_abort(ring: RingView, a, part: int, parts: int):
    """ring_host_api.cu ring_raise_abort: thread 0 records ``code`` at kHostCheck (no peer, slot or value)."""
    if ring.rank.check_descriptor():
        ring.record_error({v: k for k, v in ERROR.items()}[a.code], "kHostCheck", 0, 0, 0, 0)
    yield from ()


def moe_call_reset(memory, grid, block, shared_bytes, a) -> None:
    """The call's consumer words, every thread's grid-stride stores at once (a plain kernel: it never waits): the
    stage's idx -1, its held NO_HELD_CHUNK, the push count 0."""
    s = descriptor(memory, a.stage, "StageDesc")
    choices = s.sources * s.token_capacity * s.topk
    Pointer(memory, s.idx, "stage idx").store_as(np.int32, np.arange(choices), -1, "stage idx")
    Pointer(memory, s.held, "stage held").store_as(np.uint64, np.arange(s.sources), NO_HELD_CHUNK, "stage held")
    a.pushed.store_as(np.uint64, 0, 0, "pushed")


KERNELS = {f.__name__: f for f in (ring_publish_tensors, ring_publish_open, ring_publish_copy, ring_publish_close,
                                   moe_pull, moe_ack_held, ring_raise_abort)}


def kernels(heap, streams, only=None) -> dict:
    """The emulated kernels by name for a :class:`StreamLibrary`: each launch's blocks as generators, each block
    with its own :class:`RingView`. ``only``: replace some by name (a mutant)."""
    table = {**KERNELS, **(only or {})}

    def launcher(kernel):
        return lambda memory, grid, block, a: [kernel(RingView(memory, heap, streams, a.desc, b), a, b, grid)
                                               for b in range(grid)]

    return {name: launcher(kernel) for name, kernel in table.items()}
