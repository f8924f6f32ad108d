"""The NVSHMEM self-test kernels (device/kernels/selftest.cu): the raw signal ping-pong between PE 0
and PE 1, the floor the ring protocol is compared against. Used by the ``bringup`` job of
``chunkring-launch`` and by benchmarks/bench_ring_latency.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from chunkring.jit.launch import KernelLibrary
    from chunkring.runtime import Runtime

__all__ = ["pingpong"]


def pingpong(runtime: Runtime, lib: KernelLibrary, signal: torch.Tensor, iters: int) -> float | None:
    """Raw NVSHMEM signal round trip between PE 0 and PE 1 in microseconds (on PE 0; None elsewhere).
    A collective: every PE calls it; ``signal`` is a one-word symmetric int64 tensor, ``lib`` a
    ``KernelLibrary`` of the self-test kernels (``library_for(runtime, "selftest")``)."""
    import torch

    signal.zero_()
    runtime.barrier()
    elapsed = torch.zeros(1, dtype=torch.int64, device=runtime.torch_device)
    if runtime.rank in (0, 1):
        lib.launch("selftest_pingpong", signal=signal, peer=1 - runtime.rank, iters=iters,
                   initiator=int(runtime.rank == 0), elapsed_ns=elapsed, block=32)
    torch.cuda.synchronize()
    runtime.barrier()
    return elapsed.item() / iters / 1e3 if runtime.rank == 0 else None
