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
(A one-rank call's plan without the ring: tests/unit/test_local_plan_emulation.py.)
What only a GPU shows: memory ordering (the fences), RMA peers, the timeline trace, timeouts."""

from __future__ import annotations

import pytest

import chunkring.ring.io
from chunkring import PayloadFormat
from chunkring.ring.io import publish_chunk
from tests.helpers.emulation import pull as pull_emu
from tests.helpers.emulation.machine import EmulatedMemoryError
from tests.helpers.emulation.waves import EmulatedWaitBlocks
from tests.helpers.emulation.world import World


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
    def acked_first(ring_, s, src, seq, slot, meta, part_, parts_):
        pull_emu.finish_chunk(ring_, ring_.epoch(), src, seq, a.arrivals, parts_)
        return pull_emu.pull_visit(ring_, s, src, seq, slot, meta, part_, parts_)

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
