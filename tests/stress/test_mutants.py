"""Negative controls: each deliberately broken protocol variant (protocol/mutants.cuh) must be caught
by the stress suite. A clean run of the real protocol proves little unless these fail.

Scenarios: `no_ack_wait` - one slot, a fast producer and slow consumers, so reuse before the acks
overwrites unread chunks; `ack_any_generation` - the same run: from lap 2 on, every ack word still
holds the previous lap's generation, which the mutant counts, so the slot is reused unread;
`ignore_epoch` - stale ready words of an old epoch after a reset;
`no_release_fence` / `no_acquire_fence` - the ring stress under memory stress plus the cross-PE
message-passing litmus (two ranks or more). The mutation score is the share of
test_mutant_is_caught cases that pass. These run after the GPU suite (scripts/gpu_suite.sh): a mutant
that escapes fails its test, and under mpirun the abort hook then ends the job."""

import numpy as np
import pytest
import torch

from chunkring import Ring, RingSpec
from chunkring.ring.spec import PayloadFormat
from chunkring.ring.status import ErrorCode
from chunkring.testing.stress import MUTANTS, StressLibrary, StressPlan

pytestmark = pytest.mark.gpu

T = 4


def _ring(runtime, num_slots):
    spec = RingSpec(world_size=runtime.world_size, num_slots=num_slots, tokens_per_slot=T, hidden=256,
                    payload=PayloadFormat.FP8_E4M3, topk=4, num_experts=8 * runtime.world_size)
    return Ring(runtime, spec, timeout_s=5.0)


def _stress_fails(runtime, lib, ring, plan, seed, max_delay_ns) -> str | None:
    received = lib.run_stress(ring, plan, seed=seed, max_delay_ns=max_delay_ns, stress_blocks=16)
    torch.cuda.synchronize()
    record = ring.status()
    if not record.ok:
        return record.describe()
    if received.tolist() != plan.tokens.sum(axis=0).tolist():
        return f"received {received.tolist()} tokens, planned {plan.tokens.sum(axis=0).tolist()}"
    return None


def _collective_any(runtime, failure: str | None) -> list:
    if runtime.world_size == 1:
        return [failure] if failure else []
    from mpi4py import MPI

    return [f for f in MPI.COMM_WORLD.allgather(failure) if f]


def scenario(runtime, mutant: str) -> list:
    """Run the scenario aimed at ``mutant``; returns what any rank caught (empty = escaped)."""
    lib = StressLibrary(runtime, mutant)
    rng = np.random.default_rng(7)
    caught = []
    if mutant in ("no_ack_wait", "ack_any_generation", "none"):
        ring = _ring(runtime, 1)
        plan = StressPlan(np.full((200, runtime.world_size), 3 * T, dtype=np.int32))
        caught.append(_stress_fails(runtime, lib, ring, plan, seed=1, max_delay_ns=20_000))
        runtime.barrier()
        ring.destroy()
    if mutant in ("ignore_epoch", "none"):
        ring = _ring(runtime, 1)
        record = lib.run_stale_epoch(ring, T)
        caught.append(None if record.cause == ErrorCode.STALE_EPOCH  # here or, through its abort, at a peer
                      else f"stale value not rejected: {record.describe()}")
        runtime.barrier()
        ring.destroy()
    if mutant in ("no_release_fence", "no_acquire_fence", "none"):
        for num_slots in (1, 2):
            ring = _ring(runtime, num_slots)
            for launch in range(3):
                plan = StressPlan.random(rng, 300, runtime.world_size, 2 * T * num_slots)
                fails = _stress_fails(runtime, lib, ring, plan, seed=launch, max_delay_ns=300)
                failures = _collective_any(runtime, fails)
                caught.extend(failures)
                if failures:  # every rank stops together: the next launch must pair across ranks
                    break
            runtime.barrier()
            ring.destroy()
        if runtime.world_size >= 2:
            violations = lib.run_litmus(writer=0, reader=1, iters=50_000)
            caught.append(f"litmus: {violations} message-passing violations" if violations else None)
    return _collective_any(runtime, next((c for c in caught if c), None))


def test_real_protocol_passes_every_scenario(runtime):
    assert scenario(runtime, "none") == []


#: Fence mutants need a machine whose memory system can show the reordering they allow. With every
#: rank on one GPU (one L2), neither the ring stress nor the message-passing litmus has shown a
#: violation without the fences (tests/gpu_results/, docs/PROTOCOL.md "Evidence"); these cases are
#: expected to escape there and must be caught on a multi-GPU NVLink node.
FENCE_MUTANTS = ("no_release_fence", "no_acquire_fence")


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m != "none"])
def test_mutant_is_caught(runtime, mutant):
    caught = scenario(runtime, mutant)
    print(f"mutant {mutant}: {'CAUGHT: ' + caught[0] if caught else 'ESCAPED'}")
    if not caught and mutant in FENCE_MUTANTS and torch.cuda.device_count() == 1:
        pytest.xfail(f"{mutant} escaped: all ranks share one GPU's L2, where this reordering was never observed")
    assert caught, f"mutant {mutant} escaped the stress suite"
