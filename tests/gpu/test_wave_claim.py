"""The waves' wait (device/kernels/moe_experts.cu moe_wave_claim; docs/PROTOCOL.md, "Incremental expert
blocks"), on hand-made pool words: a wave starts once `min_blocks` sealed blocks are unclaimed, and the count
it decides that from - seals counted (`kSealed`) minus blocks claimed (`kClaimed`) - must not wrap when the
claims run ahead of the count. They do: a sealer stores the seal, then counts it, so a wave can claim a block
whose seal is not counted yet. The wrapped u32 difference (about 4 billion) started the next wave at once,
with nothing to claim. moe/blocks.cuh `sealed_unclaimed` reads "none" there; its static_asserts pin the
arithmetic on the host (every kernel build, tests/compile), this test the kernel that uses it."""

import numpy as np
import pytest
import torch

from chunkring import Ring, RingSpec
from chunkring.jit import library_for
from chunkring.moe._engine.blocks import HEADER_WORDS, BlockPool, pool_shape
from chunkring.ring.spec import PayloadFormat
from chunkring.ring.status import ErrorCode, Site

pytestmark = pytest.mark.gpu

#: moe/blocks.cuh: the Counter words and the state bits.
POOL_NEXT, CLAIMED, SEALED = 0, 3, 4
SEALED_BIT, CLAIMED_BIT = 1 << 30, 1 << 31
ROWS = 5  # rows in each hand-made block
CLAIM_BLOCK = 256
WAIT_S = 0.5  # the wave that must not start waits this long, then its watchdog records the wait


def set_words(pool, counters, blocks):
    """Zero the pool's words, then set ``counters`` {index: value} and, per pool block id, (state, expert)."""
    s = pool.shape
    words = np.zeros(s.words, dtype=np.uint32)
    for index, value in counters.items():
        words[index] = value
    landed = HEADER_WORDS + s.experts * (1 + s.blocks_per_expert)
    for block, (state, expert) in blocks.items():
        words[landed + block] = ROWS
        words[landed + s.blocks + block] = state
        words[landed + 2 * s.blocks + block] = expert
    pool.words.copy_(torch.from_numpy(words.view(np.int32)))


def claim(library, ring, pool, counts, min_blocks):
    library.launch("moe_wave_claim", desc=ring.desc, pool_desc=pool.desc, min_blocks=min_blocks, last=0, counts=counts,
                   grid=1, block=CLAIM_BLOCK)
    torch.cuda.synchronize()


def test_a_wave_waits_while_the_claims_run_ahead_of_the_seal_count(runtime):
    W, device = runtime.world_size, runtime.torch_device
    spec = RingSpec(world_size=W, num_slots=1, tokens_per_slot=8, hidden=256, payload=PayloadFormat.FP8_E4M3,
                    topk=2, num_experts=2 * W)
    pool = BlockPool(pool_shape(8, 2, W, 2, 128), 256, True, device)
    assert pool.shape.blocks >= 2
    library = library_for(runtime, "moe_experts")
    counts = torch.zeros(pool.shape.experts, dtype=torch.int32, device=device)
    with Ring(runtime, spec, timeout_s=30) as ring:
        # The control: block 0 claimed by an earlier wave, block 1 sealed and counted - one unclaimed, so the
        # wave starts at once and claims it.
        set_words(pool, {POOL_NEXT: 2, CLAIMED: 1, SEALED: 2},
                  {0: (CLAIMED_BIT | ROWS, 0), 1: (SEALED_BIT | ROWS, 1)})
        claim(library, ring, pool, counts, min_blocks=1)
        ring.check()
        assert counts.tolist() == [0, ROWS]
        words = pool.words.cpu().numpy().view(np.uint32)
        assert words[CLAIMED] == 2, "the wave claimed block 1 alone"
        # Every rank past the control before any starts the wait that ends in a watchdog: that watchdog's abort
        # would otherwise reach a rank still checking the control.
        runtime.barrier(timeout_s=60, what="the control's end")

        # Block 0 claimed, its seal not counted yet: claimed 1, sealed 0. Nothing is unclaimed, so the wave
        # must wait - here until its watchdog, since no seal will come.
        counts.zero_()
        set_words(pool, {POOL_NEXT: 1, CLAIMED: 1, SEALED: 0}, {0: (CLAIMED_BIT | ROWS, 0)})
        ring.set_timeout(WAIT_S)
        claim(library, ring, pool, counts, min_blocks=1)
        record = ring.status()
        assert not record.ok, "the wave started with no unclaimed sealed block (the count wrapped)"
        # Every rank's wave waits alike; the first watchdog aborts the others, which stop the same wait.
        assert record.code in (ErrorCode.TIMEOUT, ErrorCode.PEER_ABORTED), record
        assert record.site == Site.WAIT_BLOCKS, record
        if record.code == ErrorCode.TIMEOUT:
            assert (record.expected, record.observed) == (1, 0), record
        assert counts.tolist() == [0, 0]
        runtime.barrier()
