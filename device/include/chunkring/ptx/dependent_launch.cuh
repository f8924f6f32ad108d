// Programmatic dependent launch (Hopper, PTX `griddepcontrol`). A kernel launched with programmatic stream
// serialization (chunkring.jit's launch(..., pdl=True)) may start before the kernel ahead of it in its stream has
// finished - once every block of that kernel released its dependents or exited - so its launch and the scheduling
// of its blocks overlap that kernel's tail instead of following it. With ordering.cuh, mma.cuh and load.cuh, the
// only `asm`.
#pragma once

namespace chunkring::ptx {

// Lets the stream's next kernel, if launched with pdl, start now: its blocks become resident and wait in
// wait_prior_grid. Only kernels that never spin call it: a dependent's waiting blocks hold SM resources, which a
// kernel that waits for other ranks' progress must not leave them to take while it spins.
__device__ __forceinline__ void release_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the kernel ahead of this one in its stream has completed and its memory operations are visible to
// this grid: without it, a pdl launch could read its inputs before they are written, or overwrite what that
// kernel still reads. A kernel launched with pdl calls it before its first global memory access; in a kernel
// launched without pdl it returns at once.
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace chunkring::ptx
