"""The ring protocol on the GPU: >=10,000 self-describing chunks per configuration through the real
device API, with ring wrap, random delays on both sides, both publish orders, zero-token and
whole-empty ranks, 1 and 2 slots, several launches (replays) per epoch, stale signals and stale acks
of an old epoch, and a message-passing litmus under memory stress. Runs with 1 rank or under mpirun."""

import numpy as np
import pytest
import torch

from chunkring import Ring, RingSpec
from chunkring.errors import ChunkringRuntimeError
from chunkring.ring.layout import CONTROL
from chunkring.ring.spec import PayloadFormat
from chunkring.ring.status import ErrorCode
from chunkring.testing.stress import StressLibrary, StressPlan

pytestmark = pytest.mark.gpu

TOKENS_PER_SLOT = 4


@pytest.fixture(scope="module")
def stress(runtime):
    return StressLibrary(runtime)


def make_ring(runtime, num_slots, payload=PayloadFormat.FP8_E4M3, timeout_s=20.0):
    spec = RingSpec(world_size=runtime.world_size, num_slots=num_slots, tokens_per_slot=TOKENS_PER_SLOT,
                    hidden=256, payload=payload, topk=4, num_experts=8 * runtime.world_size)
    return Ring(runtime, spec, timeout_s=timeout_s)


def run_and_check(runtime, ring, stress, plan, *, seed, max_delay_ns):
    received = stress.run_stress(ring, plan, seed=seed, max_delay_ns=max_delay_ns)
    torch.cuda.synchronize()
    ring.check()
    assert received.tolist() == plan.tokens.sum(axis=0).tolist(), "tokens lost or invented"
    return int(plan.chunks(ring.spec.tokens_per_slot).sum())


@pytest.mark.parametrize("num_slots", [1, 2])
@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
def test_ten_thousand_chunks(runtime, stress, num_slots, payload):
    rng = np.random.default_rng(1234)  # every rank draws the same plan: no communication needed
    ring = make_ring(runtime, num_slots, payload)
    consumed = published = launches = 0
    # Several launches in one epoch (counters persist on the device) until every rank has consumed
    # 10,000 chunks; every rank consumes every chunk, so all ranks agree on when to stop.
    while consumed < 10_000:
        assert launches < 40, "plan too small to reach 10,000 chunks"
        empty = (launches % runtime.world_size,) if runtime.world_size > 1 else ()
        plan = StressPlan.random(rng, invocations=300, world_size=runtime.world_size,
                                 max_tokens=3 * TOKENS_PER_SLOT * num_slots, empty_ranks=empty)
        consumed += run_and_check(runtime, ring, stress, plan, seed=launches * 7919 + runtime.rank, max_delay_ns=2000)
        published += int(plan.chunks(TOKENS_PER_SLOT)[:, runtime.rank].sum())
        launches += 1
    assert int(ring.views["control"][CONTROL["next_seq"]].item()) == published
    assert launches >= 2, "ring wrap across launches (graph-replay-like) was not exercised"
    ring.close()


def test_every_rank_empty(runtime, stress):
    ring = make_ring(runtime, 1)
    plan = StressPlan(np.zeros((50, runtime.world_size), dtype=np.int32))
    assert run_and_check(runtime, ring, stress, plan, seed=5, max_delay_ns=0) == 50 * runtime.world_size
    ring.close()


def test_reset_then_run_again(runtime, stress):
    rng = np.random.default_rng(99)
    ring = make_ring(runtime, 2)
    for _ in range(3):
        plan = StressPlan.random(rng, 40, runtime.world_size, 16)
        run_and_check(runtime, ring, stress, plan, seed=3, max_delay_ns=500)
        epoch = ring.epoch
        ring.reset()
        assert ring.epoch == epoch + 1
        assert int(ring.views["control"][CONTROL["next_seq"]].item()) == 0
    ring.close()


def test_stale_signal_of_an_old_epoch_is_reported_not_accepted(runtime, stress):
    ring = make_ring(runtime, 1, timeout_s=5.0)
    record = stress.run_stale_epoch(ring, TOKENS_PER_SLOT)
    # A rank whose wait a peer's abort stopped first reports PEER_ABORTED, naming the STALE_EPOCH that started it.
    assert record.cause == ErrorCode.STALE_EPOCH, record.describe()
    with pytest.raises(ChunkringRuntimeError, match="STALE_EPOCH"):
        ring.check()
    runtime.barrier()
    ring.close()


def test_stale_ack_of_an_old_epoch_is_reported_not_counted(runtime, stress):
    # One-swap acks: an ack word holding the previous epoch's generation is never taken for this epoch's
    # ack; whichever side meets it first reports it (the owner polling it, or the consumer whose swap
    # replaces it), on every rank, since every rank owns a poisoned slot and acks every source's chunk 0.
    ring = make_ring(runtime, 1, timeout_s=5.0)
    record = stress.run_stale_ack(ring, 2 * TOKENS_PER_SLOT)
    assert record.cause in (ErrorCode.STALE_EPOCH, ErrorCode.ACK_TAG_MISMATCH), record.describe()
    with pytest.raises(ChunkringRuntimeError, match="STALE_EPOCH|ACK_TAG_MISMATCH"):
        ring.check()
    runtime.barrier()
    ring.close()


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_litmus_message_passing(runtime, stress, direction):
    """Both directions with the protocol's fences: "push" (the writer stores into the reader's memory) and
    "pull", the ring's own (the writer stores into its own memory and SETs the reader's flag; the reader
    loads through nvshmem_ptr)."""
    if runtime.world_size < 2:
        pytest.skip("the cross-PE litmus needs two ranks")
    violations = stress.run_litmus(writer=0, reader=1, iters=20000, direction=direction)
    assert violations == 0
