"""SPIN model check of the chunkring ring protocol (docs/model/ring.pml).

One test per configuration of scripts/check_model.py.  The correct model
(W=2/S=1, W=2/S=2, W=3/S=1, with and without the stale epoch-1 injector,
interleaved and SERIALIZED) must verify with 0 errors and a complete search;
every injected bug must produce a counterexample against its own rule.

Rules pinned (property names as in ring.pml):
  NO_READ_BEFORE_PUBLISH         payload read after WAIT READY is chunk (r, q)
                                 (BUG_PUBLISH_BEFORE_DATA breaks it)
  NO_OVERWRITE_BEFORE_EVERY_ACK  P1 WAIT REUSABLE: slot s is rewritten for q
                                 only after every destination read q-S
                                 (BUG_NO_ACK_WAIT breaks it)
  NO_ABA                         accepted ready words belong to chunk (r, q)
  ACKS_RIGHT_GEN                 one ack word per (slot, destination), swapped to
                                 gen(q): every word P1 or the drain accepts was
                                 written by that destination's ack of q, this epoch
                                 (BUG_UNTAGGED_ACK, the kAckAnyGeneration mutant,
                                 breaks it with a late epoch-1 ack and, without
                                 stale messages, with the previous lap's ack)
  STALE_NEVER_ACCEPTED           the epoch in the generation rejects late
                                 epoch-1 SETs (BUG_NO_EPOCH breaks it)
  COMPLETION                     every chunk consumed, no deadlock, no ERROR
                                 without a stale cause; an empty rank still
                                 publishes one empty eos chunk
                                 (BUG_SKIP_EOS_EMPTY deadlocks; BUG_NARROW_GEN's
                                 wrapped seq makes the consumer report a false
                                 ERROR on the previous lap's generation)

Liveness (ltl ALL_FINISH: eventually every producer and consumer has finished
all invocations; protocol waits modelled as busy-waits), pinned by name below:
  live_w2s1, live_w2s2           interleaved, rank 1 empty: holds under weak
                                 fairness (pan -a -f)
  live_w2s1_unfair               ... and not without it: a spinning consumer
                                 starves the producers (acceptance cycle)
  live_serial_w2s1, _w2s2, _w3s1 SERIALIZED, <= S chunks per source: holds with
                                 no fairness assumption at all (pan -a)
  live_serial_wrap               SERIALIZED with 2 > S chunks: acceptance cycle
                                 under weak fairness (the guarantee's boundary)
  live_bug_skip_eos_empty        the empty rank's missing eos: acceptance cycle
                                 under weak fairness
  live_blk2_serial_w2s1          SERIALIZED with 2 consumer blocks per rank:
                                 holds with no fairness assumption

Multi-block consumer (PROTOCOL.md edge C3', ring.pml -DBLOCKS=2: each block
reads every chunk and arrives on a per-(source, slot) count; the last arrival
zeroes it, then acks), pinned by name below:
  blk2_w2s1, blk2_w2s2,          every property holds, NO_OVERWRITE_BEFORE_EVERY_ACK
  blk2_serial_w2s1               demanding the read of every block of every rank
  bug_ack_first_arrival          the first arrival acks: the slot is rewritten
                                 while another block still has to read it
                                 (NO_OVERWRITE_BEFORE_EVERY_ACK)
  bug_reset_after_ack            the count is zeroed after the ack: an arrival
                                 at the slot's next chunk is lost (COMPLETION)

MoE layer (PROTOCOL.md "The MoE layer on the ring", ring.pml -DHELD_ACK: each
source's end-of-stream chunk is acknowledged only after the consumer's combine
write for that source; the owner drains, then reduces), pinned by name below:
  held_w2s1, held_w2s2,          every property holds, and COMBINE_BEFORE_REDUCE:
  held_w3s1, held_w2s1_stale     a drained owner finds every consumer's combine
                                 write of the invocation (ring wraps in the call,
                                 rank 1 empty, stale injection)
  live_held_w2s1, _w2s2          ALL_FINISH, drain and held acks included, under
                                 weak fairness
  bug_ack_held_at_pull           the end-of-stream chunk acknowledged at its read:
                                 the owner reduces before a combine write lands
                                 (COMBINE_BEFORE_REDUCE)

The MoE layer as it ships (ring.pml -DHELD_ACK -DBLOCKS=2: moe_pull's grid
shares every chunk and its last arrival acks it, each source's end-of-stream
chunk gets no arrival and is held until moe_ack_held, after the whole pull and
the combine), pinned by name below:
  heldblk2_w2s1, _w2s2, _w2s1_n3  every property holds, COMBINE_BEFORE_REDUCE and
                                 every block's read included (ring wraps in the
                                 call; two acked chunks share one arrival count
                                 in one call)
  bug_ack_held_at_pull_blk2      the eos chunk acked by its last arrival
                                 (COMBINE_BEFORE_REDUCE)
  bug_ack_first_arrival_held     NO_OVERWRITE_BEFORE_EVERY_ACK
  bug_reset_after_ack_held       COMPLETION (3 chunks through 1 slot in one call)
"""
from __future__ import annotations

import pytest

from tests.model.spin_driver import MISSING, REQUIRED, WHY, check_config, check_model, needs_tools


def test_model_checker_tools_present():
    """spin and gcc are on PATH: a failure under CHUNKRING_REQUIRE_SPIN=1, else a skip."""
    if MISSING:
        if REQUIRED:
            pytest.fail(f"{WHY}; CHUNKRING_REQUIRE_SPIN=1 asks for this suite to run", pytrace=False)
        pytest.skip(WHY)


LIVENESS_PINNED = {
    "live_w2s1": (check_model.LIVE_FAIR, check_model.PASS),
    "live_w2s2": (check_model.LIVE_FAIR, check_model.PASS),
    "live_w2s1_unfair": (check_model.LIVE_ANY, check_model.CEX),
    "live_serial_w2s1": (check_model.LIVE_ANY, check_model.PASS),
    "live_serial_w2s2": (check_model.LIVE_ANY, check_model.PASS),
    "live_serial_w3s1": (check_model.LIVE_ANY, check_model.PASS),
    "live_serial_wrap": (check_model.LIVE_FAIR, check_model.CEX),
    "live_bug_skip_eos_empty": (check_model.LIVE_FAIR, check_model.CEX),
    "live_blk2_serial_w2s1": (check_model.LIVE_ANY, check_model.PASS),
    "live_held_w2s1": (check_model.LIVE_FAIR, check_model.PASS),
    "live_held_w2s2": (check_model.LIVE_FAIR, check_model.PASS),
}

BLOCKS_PINNED = {
    "blk2_w2s1": (check_model.SAFETY, check_model.PASS, None),
    "blk2_w2s2": (check_model.SAFETY, check_model.PASS, None),
    "blk2_serial_w2s1": (check_model.SAFETY, check_model.PASS, None),
    "bug_ack_first_arrival": (check_model.SAFETY, check_model.CEX,
                              "NO_OVERWRITE_BEFORE_EVERY_ACK"),
    "bug_reset_after_ack": (check_model.SAFETY, check_model.CEX, check_model.COMPLETION),
    "live_blk2_serial_w2s1": (check_model.LIVE_ANY, check_model.PASS, None),
}

HELD_PINNED = {
    "held_w2s1": (check_model.SAFETY, check_model.PASS, None),
    "held_w2s2": (check_model.SAFETY, check_model.PASS, None),
    "held_w3s1": (check_model.SAFETY, check_model.PASS, None),
    "held_w2s1_stale": (check_model.SAFETY, check_model.PASS, None),
    "bug_ack_held_at_pull": (check_model.SAFETY, check_model.CEX, "COMBINE_BEFORE_REDUCE"),
    "live_held_w2s1": (check_model.LIVE_FAIR, check_model.PASS, None),
    "live_held_w2s2": (check_model.LIVE_FAIR, check_model.PASS, None),
}

HELD_BLOCKS_PINNED = {
    "heldblk2_w2s1": (check_model.SAFETY, check_model.PASS, None),
    "heldblk2_w2s2": (check_model.SAFETY, check_model.PASS, None),
    "heldblk2_w2s1_n3": (check_model.SAFETY, check_model.PASS, None),
    "bug_ack_held_at_pull_blk2": (check_model.SAFETY, check_model.CEX, "COMBINE_BEFORE_REDUCE"),
    "bug_ack_first_arrival_held": (check_model.SAFETY, check_model.CEX,
                                   "NO_OVERWRITE_BEFORE_EVERY_ACK"),
    "bug_reset_after_ack_held": (check_model.SAFETY, check_model.CEX, check_model.COMPLETION),
}


def _blocks(c) -> bool:
    return any(m.startswith("BLOCKS=") for m in c.macros)


def test_liveness_configs_pinned():
    """The liveness checks exist with their fairness mode and expectation; a
    liveness counterexample must be an ALL_FINISH acceptance cycle."""
    live = {c.name: c for c in check_model.CONFIGS if c.check != check_model.SAFETY}
    assert {n: (c.check, c.expect) for n, c in live.items()} == LIVENESS_PINNED
    for c in live.values():
        assert "LIVENESS" in c.defines()
        if c.expect == check_model.CEX:
            assert c.prop == check_model.ALL_FINISH_CYCLE, c.name


def test_multiblock_configs_pinned():
    """The multi-block consumer checks exist with their mode, expectation and
    expected property, all with 2 blocks per rank; every other check keeps the
    single-block model (BLOCKS unset)."""
    blk = {c.name: c for c in check_model.CONFIGS if _blocks(c) and "HELD_ACK" not in c.macros}
    assert {n: (c.check, c.expect, c.prop) for n, c in blk.items()} == BLOCKS_PINNED
    for c in check_model.CONFIGS:
        if _blocks(c):
            assert "BLOCKS=2" in c.macros, c.name
        if {"BUG_ACK_FIRST_ARRIVAL", "BUG_RESET_AFTER_ACK"} & set(c.macros):   # the multi-block bugs
            assert _blocks(c), c.name


def test_held_ack_configs_pinned():
    """The MoE layer's held-ack checks exist with their mode, expectation and
    expected property; at least one safety run wraps the ring inside a call
    (more chunks from rank 0 than slots); the held-ack bug needs HELD_ACK."""
    held = {c.name: c for c in check_model.CONFIGS if "HELD_ACK" in c.macros and not _blocks(c)}
    assert {n: (c.check, c.expect, c.prop) for n, c in held.items()} == HELD_PINNED
    for c in check_model.CONFIGS:   # both streams concurrent
        if "HELD_ACK" in c.macros:
            assert "SERIALIZED" not in c.macros, c.name

    def wraps(c):
        m = dict(x.split("=") for x in c.macros if "=" in x)
        return int(m.get("N0", 2)) > int(m.get("S", 1))
    assert any(wraps(c) and c.check == check_model.SAFETY and c.expect == check_model.PASS
               for c in held.values())
    for c in check_model.CONFIGS:
        if "BUG_ACK_HELD_AT_PULL" in c.macros:
            assert "HELD_ACK" in c.macros, c.name


def test_shipped_layer_configs_pinned():
    """The MoE layer as it ships - held acks and a multi-block pull together - is checked with its
    mode, expectation and expected property: the correct model (one run wrapping the ring inside a
    call, one reusing an arrival count inside a call) and each of the held-ack and multi-block bugs."""
    both = {c.name: c for c in check_model.CONFIGS if "HELD_ACK" in c.macros and _blocks(c)}
    assert {n: (c.check, c.expect, c.prop) for n, c in both.items()} == HELD_BLOCKS_PINNED
    bugs = {"BUG_ACK_HELD_AT_PULL", "BUG_ACK_FIRST_ARRIVAL", "BUG_RESET_AFTER_ACK"}
    assert bugs <= {m for c in both.values() for m in c.macros}


@needs_tools
@pytest.mark.spin
@pytest.mark.parametrize("cfg", [c for c in check_model.CONFIGS if c.model == check_model.RING_MODEL],
                         ids=lambda c: c.name)
def test_spin_config(cfg):
    """ring.pml's configurations (blocks.pml's: tests/model/test_spin_blocks.py)."""
    check_config(cfg)
