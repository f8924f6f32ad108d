"""Jobs that ``chunkring-launch`` runs. Each exposes ``CONFIG`` (a frozen dataclass) and ``run(runtime, config)``;
``NEEDS_GPU = False`` marks one that runs without a GPU (it gets a host-only runtime)."""

import os

from . import bench, bringup, run, stress

JOBS = {"bench": bench, "bringup": bringup, "run": run, "stress": stress}

# The launcher's own tests add jobs that misbehave on purpose: ``fault`` (no GPU needed) and ``layer_fault`` (a
# MoE layer whose rank is killed at one phase: the fault matrix's kill cells).
if os.environ.get("CHUNKRING_TEST_JOBS") == "1":
    from . import fault, layer_fault

    JOBS["fault"] = fault
    JOBS["layer_fault"] = layer_fault

__all__ = ["JOBS"]
