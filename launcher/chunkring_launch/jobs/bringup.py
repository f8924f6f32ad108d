"""Bring-up check: every PE exchanges checked data through NVSHMEM signals and atomics.

Passes when every PE received every word its left neighbour sent in every round and PE 0 saw every
PE's acknowledgement bit. Also measures the raw signal ping-pong between PE 0 and PE 1, the floor the
ring protocol is later compared against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError, UsageProblems
from chunkring.testing.selftest import pingpong

from ..config import CheckedConfig, check_range

if TYPE_CHECKING:
    from chunkring import Runtime

# pingpong() lives in the library (chunkring.testing.selftest); named here for the job's users.
__all__ = ["CONFIG", "pingpong", "run"]


@dataclass(frozen=True)
class CONFIG(CheckedConfig):
    rounds: int = 8
    words_per_pe: int = 65536
    pingpong_iters: int = 2000

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        check_range(problems, self, "rounds", 1, 1024)
        check_range(problems, self, "words_per_pe", 1, 1 << 26)
        check_range(problems, self, "pingpong_iters", 1, 1 << 24)


def run(runtime: Runtime, config: CONFIG) -> dict[str, float | int]:
    """Run the check on every PE; returns this PE's figures. Raises on any data or ack error."""
    import torch

    from chunkring.jit import library_for

    if runtime.world_size > 64:
        raise ChunkringUsageError("the bring-up ack mask holds 64 PEs", field="world_size")
    lib = library_for(runtime, "selftest")
    built = lib.build
    send = runtime.alloc(config.words_per_pe, torch.int64)
    recv = runtime.alloc(config.words_per_pe, torch.int64)
    signal = runtime.alloc(1, torch.int64)
    mask = runtime.alloc(config.rounds + 1, torch.int64)
    errors = torch.zeros(1, dtype=torch.int32, device=runtime.torch_device)
    runtime.barrier()

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for rnd in range(1, config.rounds + 1):
        lib.launch("selftest_ring_pass", send=send, recv=recv, signal=signal, mask=mask, errors=errors,
                   n_words=config.words_per_pe, round=rnd, block=512)
        runtime.barrier()  # the next round's put must not land before this round's check
    stop.record()
    torch.cuda.synchronize()
    bad_words = int(errors.item())
    if bad_words:
        raise ChunkringRuntimeError(f"PE {runtime.rank}: {bad_words} words arrived wrong in the ring pass")
    if runtime.rank == 0:
        full = (1 << runtime.world_size) - 1
        seen = [int(m) & ((1 << 64) - 1) for m in mask[1:].tolist()]
        missing = [(rnd + 1, hex(m)) for rnd, m in enumerate(seen) if m != full]
        if missing:
            raise ChunkringRuntimeError(f"PE 0: ack masks incomplete (round, mask): {missing}; want {hex(full)}")

    figures = {
        "ring_pass_rounds": config.rounds,
        "ring_pass_ms_per_round": start.elapsed_time(stop) / config.rounds,
        "kernel_compile_s": built.seconds,
        "kernel_cache_hit": int(built.cache_hit),
    }
    if runtime.world_size >= 2:
        figures["pingpong_rtt_us"] = pingpong(runtime, lib, signal, config.pingpong_iters)
    return figures
