// Programmatic dependent launch (Hopper, PTX `griddepcontrol`). A kernel launched with programmatic stream
// serialization (chunkring.jit's launch(..., pdl=True)) may start before the kernel ahead of it in its stream has
// finished - once every block of that kernel released its dependents or exited - so its launch and the scheduling
// of its blocks overlap that kernel's tail instead of following it. Every `asm` of chunkring lives in ptx/.
//
// The rules (tests/compile/test_dependent_launches.py checks them in the source):
// * A kernel launched with pdl calls wait_prior_grid before it touches anything the kernels of its call write or
//   read - as its first statement, or after reading only what the next rule makes final (the decode GEMMs: their
//   expert's row count, and the weights, which no kernel writes). Where a block may end without waiting (the
//   decode GEMMs' blocks of idle experts), block 0 waits all the same: the kernel then completes only after the
//   kernel ahead of it has, so what follows in the stream finds every kernel ahead complete.
// * A kernel releases its dependents only after its own wait_prior_grid (at its start if it is not launched with
//   pdl): so once a kernel has been let start, every kernel two or more ahead of it in its stream has completed.
// * Only kernels that wait for nothing outside their own grid release: a dependent's waiting blocks hold SM
//   resources, which a kernel that waits for other ranks' or grids' progress must not leave them to take while it
//   spins. The persistent decode consumer's waits are for its own blocks, every one of which has started (and
//   released) before its dependent may be placed.
#pragma once

namespace chunkring::ptx {

// Lets the stream's next kernel, if launched with pdl, start now: its blocks become resident and wait in
// wait_prior_grid.
__device__ __forceinline__ void release_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the kernel ahead of this one in its stream has completed and its memory operations are visible to
// this grid: without it, a pdl launch could read its inputs before they are written, or overwrite what that
// kernel still reads. In a kernel launched without pdl it returns at once.
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace chunkring::ptx
