"""The fail-closed paths of the ring at 2 ranks, the kernels emulated as written (tests/helpers/emulation/pull.py and
ring.py: real Rings over one symmetric heap, the globaltimer a deterministic Clock) and the host's own functions
reading what they left. A stalled call - rank 1 publishes three chunks of a stream it never ends through 2 slots
and never pulls, rank 0 publishes one chunk and pulls, with a 1 s watchdog against rank 1's 5 s - makes rank 0's
pull time out waiting for rank 1's third chunk while rank 1's third publish waits for its own ack.

What it pins (protocol/status.cuh record_error, raise_abort, abort_word, spin_until; ring_host_api.cu
ring_raise_abort; chunkring.ring.failure, Ring.raise_if_failed / check / reset): the origin's status record and
failure word (the abort word: epoch, origin, code); every rank's abort notice set and its abort word adopted, the
first abort that reached a rank keeping its abort word; the peer's waiting producer stopped with PEER_ABORTED naming
the origin, long before its own watchdog, its failure word that abort word; the typed host errors on each rank; an
abort that issues no fetching operation, so a peer that never answers holds back neither the origin's kernel nor
the other ranks (a mutant with the old remote swaps waits for ever; one without the notice leaves the peer waiting
for its own watchdog); the host's HOST_USAGE abort stopping a waiting peer; a reset zeroing every abort word and
failure word, the next call running clean. Not here: memory ordering, real time, the quiet, a synchronise that
never returns."""

from __future__ import annotations

import numpy as np
import pytest

import chunkring.ring.io
from chunkring import PayloadFormat
from chunkring.errors import ChunkringDeviceError, ChunkringPeerAbortedError, ChunkringTimeoutError
from chunkring.ring.io import publish_chunk, raise_abort
from chunkring.ring.layout import STATUS
from chunkring.ring.status import AbortRecord, ErrorCode, Site
from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation.machine import EmulatedMemoryError
from tests.helpers.emulation.pull_reference import Expected
from tests.helpers.emulation.ring import CONTROL, Clock, HeapRank
from tests.helpers.emulation.waves import EmulatedWaitBlocks
from tests.helpers.emulation.world import E, World

ORIGIN_WATCHDOG_NS, PEER_WATCHDOG_NS = 10**9, 5 * 10**9


def abort_words(ring) -> tuple[int, int, int]:
    """(abort word, abort notice, failure word) of one rank, unsigned."""
    status = ring.views["status"]
    return (int(status[STATUS["abort"]]) % 2**64, int(status[STATUS["abort_notice"]]) % 2**64, ring.failure.read())


def publish(w: World, src: int, sizes: list[int], end: bool) -> None:
    batch = w.batch(sizes)
    for base, m, last in batch.chunks():
        rows = slice(base, base + m)
        publish_chunk(w.rings[src], x=batch.x[rows], x_sf=None, topk_idx=batch.idx[rows], topk_weights=batch.w[rows],
                      token_base=base, end_of_stream=last and end)


def stalled(monkeypatch, seed: int = 0, origin: int = 0) -> World:
    """The stalled call, ``origin``'s watchdog firing first (rank 0's pull, or rank 1's third publish)."""
    w = World(monkeypatch, 2, PayloadFormat.BF16, seed=seed, clock=Clock())
    w.rings[origin].set_timeout(ORIGIN_WATCHDOG_NS / 1e9)
    publish(w, 0, [2], end=True)
    publish(w, 1, [2, 2, 2], end=False)
    w.pull(0)
    return w


def word(w: World, origin: int, code: ErrorCode) -> int:
    return AbortRecord.make(w.rings[0].epoch, origin, code).word


@pytest.mark.parametrize("seed", [0, 1])
def test_a_timeout_aborts_every_rank_and_each_host_raises_its_typed_error(monkeypatch, seed):
    w = stalled(monkeypatch, seed)
    w.streams.run()
    assert ORIGIN_WATCHDOG_NS < w.clock.now < PEER_WATCHDOG_NS, "rank 1 stopped before its own watchdog"
    abort = word(w, 0, ErrorCode.TIMEOUT)
    origin, peer = w.rings[0].status(), w.rings[1].status()
    assert (origin.code, origin.site, origin.pe, origin.peer, origin.slot) == (ErrorCode.TIMEOUT, Site.WAIT_ROUTE,
                                                                              0, 1, 0)
    assert (peer.code, peer.site, peer.pe, peer.peer, peer.observed) == (ErrorCode.PEER_ABORTED, Site.WAIT_REUSABLE,
                                                                        1, 1, abort)
    assert [abort_words(ring) for ring in w.rings] == [(abort, abort, abort)] * 2
    for call in ("raise_if_failed", "check"):
        with pytest.raises(ChunkringTimeoutError) as timeout:
            getattr(w.rings[0], call)()
        assert timeout.value.record.site == Site.WAIT_ROUTE and timeout.value.record.peer == 1
        with pytest.raises(ChunkringPeerAbortedError) as aborted:
            getattr(w.rings[1], call)()
        assert (aborted.value.origin_rank, aborted.value.code) == (0, ErrorCode.TIMEOUT)


def abort_with_remote_swaps(rank: HeapRank, abort: int) -> None:
    """Mutant: raise_abort as it was - the notices, then a fetching compare-and-swap into every rank's abort word."""
    for pe in range(rank.d.world_size):
        rank.signal_set("kStatusAbortNotice", abort, pe)
    for i in range(rank.d.world_size):
        rank.fetching_cas("kStatusAbort", 0, abort, (rank.d.my_pe + i) % rank.d.world_size)


@pytest.mark.parametrize("mutant", [False, True])
def test_a_peer_that_never_answers_holds_back_neither_the_origin_nor_the_others(monkeypatch, mutant):
    """Rank 1 never answers a fetching operation (an unreachable node). The origin's abort issues none: its kernel
    ends (so a synchronise, Ring.check and Runtime.close end too), and rank 1 stops on the notice, adopting it into
    its own abort word. The mutant's remote swaps leave the origin's kernel waiting for ever."""
    if mutant:
        monkeypatch.setattr(HeapRank, "raise_abort", abort_with_remote_swaps)
    w = stalled(monkeypatch)
    w.heap.fetch_hangs.add(1)
    if mutant:
        with pytest.raises(EmulatedWaitBlocks, match="PE 0 waits for ever for PE 1's answer"):
            w.streams.run()
        return
    w.streams.run()
    assert w.clock.now < PEER_WATCHDOG_NS
    abort = word(w, 0, ErrorCode.TIMEOUT)
    peer = w.rings[1].status()
    assert (peer.code, peer.observed) == (ErrorCode.PEER_ABORTED, abort)
    assert [abort_words(ring) for ring in w.rings] == [(abort, abort, abort)] * 2
    with pytest.raises(ChunkringPeerAbortedError) as aborted:
        w.rings[1].raise_if_failed()
    assert aborted.value.origin_rank == 0


def abort_without_notice(rank: HeapRank, abort: int) -> None:
    """Mutant: raise_abort's own abort word alone, no notice."""
    rank.status_word("kStatusAbort", rank.d.my_pe).cas_as(np.uint64, 0, 0, abort, "kStatusAbort")


def test_without_the_notice_that_peer_waits_for_its_own_watchdog(monkeypatch):
    monkeypatch.setattr(HeapRank, "raise_abort", abort_without_notice)
    w = stalled(monkeypatch)
    w.streams.run()
    assert w.rings[1].status().code == ErrorCode.TIMEOUT and w.clock.now > PEER_WATCHDOG_NS


def test_a_host_usage_abort_stops_the_peer_waiting_in_the_call(monkeypatch):
    w = World(monkeypatch, 2, PayloadFormat.BF16, clock=Clock())
    w.pull(1)  # nobody publishes: it waits for rank 0's first chunk
    raise_abort(w.rings[0], ErrorCode.HOST_USAGE)
    w.streams.run()
    assert w.clock.now == 0, "no watchdog fired"
    abort = word(w, 0, ErrorCode.HOST_USAGE)
    origin, peer = w.rings[0].status(), w.rings[1].status()
    assert (origin.code, origin.site, origin.peer, origin.slot, origin.observed) == (ErrorCode.HOST_USAGE,
                                                                                     Site.HOST_CHECK, 0, 0, 0)
    assert (peer.code, peer.site, peer.peer, peer.observed) == (ErrorCode.PEER_ABORTED, Site.WAIT_ROUTE, 0, abort)
    assert [abort_words(ring) for ring in w.rings] == [(abort, abort, abort)] * 2
    with pytest.raises(ChunkringDeviceError) as refused:
        w.rings[0].raise_if_failed()
    assert type(refused.value) is ChunkringDeviceError and refused.value.record.code == ErrorCode.HOST_USAGE
    with pytest.raises(ChunkringPeerAbortedError) as aborted:
        w.rings[1].raise_if_failed()
    assert (aborted.value.origin_rank, aborted.value.code) == (0, ErrorCode.HOST_USAGE)


def test_the_first_abort_keeps_the_abort_word_at_every_rank(monkeypatch):
    w = World(monkeypatch, 2, PayloadFormat.BF16, clock=Clock())
    for rank in (0, 1):
        raise_abort(w.rings[rank], ErrorCode.HOST_USAGE)
        w.streams.run()
    first, second = word(w, 0, ErrorCode.HOST_USAGE), word(w, 1, ErrorCode.HOST_USAGE)
    assert [abort_words(ring) for ring in w.rings] == [(first, second, first), (first, second, second)]
    with pytest.raises(ChunkringDeviceError, match="rank 0's abort .* reached this rank first"):
        w.rings[1].check()


def test_a_reset_clears_every_abort_and_the_next_call_runs_clean(monkeypatch):
    w = stalled(monkeypatch)
    w.streams.run()
    epoch = w.rings[0].epoch
    for ring in w.rings:
        ring.reset()
    for ring in w.rings:
        assert ring.epoch == epoch + 1 and abort_words(ring) == (0, 0, 0) and ring.status().ok
        ring.raise_if_failed()
        ring.check()
    w.expected, w.masked, now = Expected(w.rings, w.stages, E), [0, 0], w.clock.now
    w.call([[3, 2], [4]])
    w.ack_held()
    w.expected.check(w.masked)
    assert w.clock.now == now, "no watchdog fired"
    assert all(abort_words(ring) == (0, 0, 0) for ring in w.rings)


def ungated_copy(ring, a, part, parts):
    """Mutant: ring_publish_copy without the error gate - it copies even after the split publish's open failed."""
    e = pull_emu.chunk_extent(ring, a, False)
    if ring.rank.check_descriptor() and e.publish:
        pull_emu.copy_rows(ring, pull_emu.next_seq(ring), a, e.n, part, parts)
    yield from ()


def split_stall(monkeypatch, mutants: dict | None = None) -> World:
    """The stalled call with every chunk published in three kernels (open, copy, close): rank 1's third publish is
    stopped in its open, its slot still holding the chunk it waits to be acknowledged."""
    monkeypatch.setattr(chunkring.ring.io, "PUBLISH_BYTES_PER_BLOCK", 256)  # every chunk: open, copy x n, close
    w = World(monkeypatch, 2, PayloadFormat.BF16, clock=Clock(), mutants=mutants)
    w.rings[0].set_timeout(ORIGIN_WATCHDOG_NS / 1e9)
    publish(w, 0, [2], end=True)
    publish(w, 1, [2, 2, 2], end=False)
    w.pull(0)
    return w


def test_after_a_failed_open_the_split_publish_writes_nothing(monkeypatch):
    """The open records the failure; the copy and the close see it (has_error) and leave the slot - still another
    lap's, unacknowledged - and the cursor as they were: no peer reads a half-written chunk."""
    w = split_stall(monkeypatch)
    launched = {name for name, *_ in w.library.launches}
    assert {"ring_publish_open", "ring_publish_copy", "ring_publish_close"} <= launched
    w.streams.run()
    peer = w.rings[1].status()
    assert (peer.code, peer.site) == (ErrorCode.PEER_ABORTED, Site.WAIT_REUSABLE)
    assert w.rings[1].views["meta"][0].tolist()[:2] == [0, 2]  # slot 0 still holds chunk 0: rows 0-1, not 4-5
    assert int(w.rings[1].views["control"][CONTROL["kControlNextSeq"]]) == 2  # the third chunk: never published


def test_a_copy_without_the_error_gate_is_caught(monkeypatch):
    w = split_stall(monkeypatch, mutants={"ring_publish_copy": ungated_copy})
    with pytest.raises(EmulatedMemoryError, match="before every destination acknowledged"):
        w.streams.run()
