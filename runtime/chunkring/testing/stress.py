"""Launch wrappers for the protocol stress and litmus kernels (device/kernels/ring_stress.cu)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chunkring.errors import ChunkringUsageError
from chunkring.jit.launch import library_for
from chunkring.ring.kernel_args import RingStressArgs

if TYPE_CHECKING:
    import torch

    from chunkring.ring.ring import Ring
    from chunkring.ring.status import StatusRecord
    from chunkring.runtime import Runtime

__all__ = ["ARRIVE_BEFORE_ROWS", "LITMUS_DIRECTIONS", "MUTANTS", "NO_HELD_ACK", "NO_INPUT_CHECKS", "NO_PUSH_RELEASE",
           "REDUCE_AFTER_ERROR", "REDUCE_EVERY_CHOICE", "SEAL_ON_RESERVE", "StressLibrary", "StressPlan"]

#: protocol/mutants.cuh Mutant values (append-only): the protocol's, which the stress suite must catch.
MUTANTS = {"none": 0, "no_release_fence": 1, "no_acquire_fence": 2, "no_ack_wait": 3, "ignore_epoch": 4,
           "ack_any_generation": 7, "no_ack_release": 9, "no_ack_acquire": 10, "no_arrival_fences": 11,
           "gpu_scope_fences": 12}
#: The consumer-input mutant (protocol/validate.cuh checks off): caught by tests/gpu/test_fuzz_inputs.py,
#: and the baseline that benchmarks/bench_input_checks.py measures the checks' cost against.
NO_INPUT_CHECKS = 5
#: protocol/mutants.cuh kNoDeferredAck, as the MoE layer meets it: a source's last chunk acknowledged at
#: its pull, before the combine rows that the held acknowledgement promises its owner (caught by
#: tests/gpu/test_moe_layer.py).
NO_HELD_ACK = 6
#: protocol/mutants.cuh kNoPushRelease: the combine push's blocks arrive on the push count without releasing
#: their stores, so the held acknowledgement no longer orders them (tests/gpu/test_moe_layer.py).
NO_PUSH_RELEASE = 8
#: protocol/mutants.cuh kSealOnReserve: an incremental expert block sealed when its last row is reserved,
#: before its rows landed (docs/PROTOCOL.md, "The GPU mutant"; caught by tests/gpu/test_moe_blocks.py).
SEAL_ON_RESERVE = 13
#: protocol/mutants.cuh kArriveBeforeRows: each block of the fused producer (moe_produce.cu) arrives before it
#: stores its rows, so the last arrival publishes a chunk still being written (caught by
#: tests/stress/test_fused_producer_mutants.py).
ARRIVE_BEFORE_ROWS = 14
#: protocol/mutants.cuh kReduceEveryChoice: the owner's reduction adds every choice's combine row, routed or not;
#: nothing writes or zeroes a masked choice's row, so it adds whatever the buffer held (caught by
#: tests/gpu/test_moe_reduce.py).
REDUCE_EVERY_CHOICE = 15
#: protocol/mutants.cuh kReduceAfterError: a call whose drain gave up still sums the combine rows it finds, some of them
#: another call's, instead of returning zeros (caught by tests/gpu/test_moe_reduce.py).
REDUCE_AFTER_ERROR = 16
#: The message-passing litmus kernels of ring_stress.cu: "push", the writer stores into the reader's memory
#: (litmus_mp); "pull", the ring's own direction: the writer stores into its own memory and SETs the
#: reader's flag, the reader loads through nvshmem_ptr (litmus_mp_pull).
LITMUS_DIRECTIONS = {"push": "litmus_mp", "pull": "litmus_mp_pull"}


@dataclass(frozen=True)
class StressPlan:
    """Tokens each rank produces in each invocation: ``tokens[i][r]`` (0 = an empty rank that round)."""

    tokens: np.ndarray  # [invocations, world_size] int32

    @classmethod
    def random(cls, rng: np.random.Generator, invocations: int, world_size: int, max_tokens: int,
               empty_ranks: tuple[int, ...] = ()) -> StressPlan:
        tokens = rng.integers(0, max_tokens + 1, size=(invocations, world_size), dtype=np.int32)
        # Zero is over-represented on purpose: it is the case peers' issue trackers are full of.
        tokens[rng.random((invocations, world_size)) < 0.15] = 0
        for rank in empty_ranks:
            tokens[:, rank] = 0
        return cls(tokens)

    def chunks(self, tokens_per_slot: int) -> np.ndarray:
        """Chunks each rank publishes per invocation: an empty rank still publishes one (end of stream)."""
        return np.maximum(1, -(-self.tokens // tokens_per_slot))


class StressLibrary:
    """The stress kernels built for one protocol variant (``mutant`` names one of ``MUTANTS``)."""

    def __init__(self, runtime: Runtime, mutant: str = "none") -> None:
        if mutant not in MUTANTS:
            raise ChunkringUsageError(f"unknown mutant {mutant!r}; have {sorted(MUTANTS)}", field="mutant")
        self.mutant = mutant
        self.runtime = runtime
        self.library = library_for(runtime, "ring_stress", defines={"CHUNKRING_MUTANT": MUTANTS[mutant]})

    def run_stress(self, ring: Ring, plan: StressPlan, *, seed: int, max_delay_ns: int, stress_blocks: int = 4,
                   consumer_blocks: int = 1, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Enqueue one ring_stress launch; returns the ``received`` tensor [world_size] (tokens per source).
        ``consumer_blocks`` > 1: every consumer block checks every chunk and the last one to finish it
        acknowledges it (ring.cuh finish_chunk: the multi-block consumer). Such a consumer reads its cursors
        once per kernel (consume_invocation: before any block can arrive and advance them), so the plan must
        then hold one invocation; the ring still wraps within it."""
        import torch

        if plan.tokens.ndim != 2 or plan.tokens.shape[1] != ring.spec.world_size:
            raise ChunkringUsageError(f"plan must be [invocations, {ring.spec.world_size}]", field="plan")
        if not 0 <= stress_blocks <= 128:
            raise ChunkringUsageError("must be in [0, 128]", field="stress_blocks")
        if not 1 <= consumer_blocks <= 16:  # every block of the grid resident at once, whatever the rank count
            raise ChunkringUsageError("must be in [1, 16]", field="consumer_blocks")
        if consumer_blocks > 1 and plan.tokens.shape[0] != 1:
            raise ChunkringUsageError("a multi-block consumer runs one invocation per launch", field="plan")
        device = self.runtime.torch_device
        plan_dev = torch.from_numpy(np.ascontiguousarray(plan.tokens, dtype=np.int32)).to(device)
        received = torch.zeros(ring.spec.world_size, dtype=torch.int64, device=device)
        stress = torch.zeros(1 << 20, dtype=torch.int64, device=device)
        arrivals = (torch.zeros(ring.spec.world_size * ring.spec.num_slots, dtype=torch.int32, device=device)
                    if consumer_blocks > 1 else None)
        self.library.launch("ring_stress", args=RingStressArgs(
            desc=ring.desc, plan=plan_dev, invocations=plan.tokens.shape[0], seed=seed, max_delay_ns=max_delay_ns,
            received=received, stress=stress, stress_words=stress.numel(), arrivals=arrivals,
            consumer_blocks=consumer_blocks), grid=1 + consumer_blocks + stress_blocks, block=256, stream=stream)
        return received

    def run_stale_epoch(self, ring: Ring, tokens: int) -> StatusRecord:
        """Reset ``ring``, then let a late ready signal of the previous epoch (what its lap 0 published)
        land in every ready word of slot 0 before producers publish (they wait ~50 ms first). Returns
        this rank's status record: the real protocol reports STALE_EPOCH and accepts nothing. A collective.
        """
        def plant(stale: int) -> None:
            for name in ("route_ready", "layout_ready"):
                ring.views[name][:, 0] = stale

        return self._run_after_stale_words(ring, plant, tokens, seed=11, max_delay_ns=50_000_000)

    def run_stale_ack(self, ring: Ring, tokens: int) -> StatusRecord:
        """Reset ``ring`` (one slot), then let a late ack of the previous epoch (its lap 0's generation) land in
        every destination's ack word of this rank's slot 0 before anyone acks; every rank publishes ``tokens``
        rows, more than a slot holds, so each owner waits for the acks of its chunk 0 before reusing the
        slot. Returns this rank's status record: the real protocol never counts the stale word - an owner
        that polls it reports STALE_EPOCH, a consumer whose swap replaces it ACK_TAG_MISMATCH. A collective.
        """
        if ring.spec.num_slots != 1 or tokens <= ring.spec.tokens_per_slot:
            raise ChunkringUsageError("needs a one-slot ring and more tokens than a slot holds", field="tokens")

        def plant(stale: int) -> None:
            ring.views["ack"][0, : ring.spec.world_size] = stale

        return self._run_after_stale_words(ring, plant, tokens, seed=13, max_delay_ns=0)

    def _run_after_stale_words(self, ring: Ring, plant: Callable[[int], None], tokens: int, *, seed: int,
                               max_delay_ns: int) -> StatusRecord:
        """Reset ``ring``, ``plant`` the previous epoch's lap-0 generation in some of this rank's words, then
        run one invocation of ``tokens`` rows per rank; this rank's status record."""
        import torch

        ring.reset()
        plant(((ring.epoch - 1) << (64 - ring.spec.epoch_bits)) | 1)
        torch.cuda.synchronize()
        self.runtime.barrier()
        plan = StressPlan(np.full((1, ring.spec.world_size), tokens, dtype=np.int32))
        self.run_stress(ring, plan, seed=seed, max_delay_ns=max_delay_ns)
        torch.cuda.synchronize()
        return ring.status()

    def run_litmus(self, writer: int, reader: int, iters: int, lanes: int = 256, stress_blocks: int = 16,
                   direction: str = "push") -> int:
        """Message-passing litmus between two PEs, beside ``stress_blocks`` memory-stress blocks on
        every PE; returns the violation count seen by ``reader``. ``direction`` names one of
        ``LITMUS_DIRECTIONS``: "push" (the writer stores into the reader's memory) or "pull" (the ring's:
        the writer stores into its own memory, the reader loads through nvshmem_ptr). A collective."""
        import torch

        if direction not in LITMUS_DIRECTIONS:
            raise ChunkringUsageError(f"unknown direction {direction!r}; have {sorted(LITMUS_DIRECTIONS)}",
                                      field="direction")
        if lanes <= 0 or lanes % 32:
            raise ChunkringUsageError("must be a positive multiple of 32", field="lanes")
        if not 0 <= stress_blocks <= 128:
            raise ChunkringUsageError("must be in [0, 128]", field="stress_blocks")
        lines = self.runtime.alloc(lanes * 32, torch.int64)
        violations = torch.zeros(1, dtype=torch.int64, device=self.runtime.torch_device)
        stress = torch.zeros(1 << 20, dtype=torch.int64, device=self.runtime.torch_device)
        self.runtime.barrier()
        self.library.launch(LITMUS_DIRECTIONS[direction], lines=lines, writer=writer, reader=reader, iters=iters,
                            violations=violations, mp_blocks=lanes // 32, stress=stress, stress_words=stress.numel(),
                            grid=lanes // 32 + stress_blocks, block=32)
        torch.cuda.synchronize()
        self.runtime.barrier()
        self.runtime.free(lines)
        return int(violations.item())
