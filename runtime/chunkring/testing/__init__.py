"""What tests and benchmarks use and a serving stack never does: the fp32 MoE reference and the torch
reference of the row kernels (:mod:`~chunkring.testing.reference`), the host dispatch planner the device
plan is checked against (:mod:`~chunkring.testing.plan`), the protocol stress/litmus harness with its
mutants (:mod:`~chunkring.testing.stress`). Import the submodules directly.
"""
