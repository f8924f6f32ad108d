"""Jobs that ``chunkring-launch`` runs. Each exposes ``CONFIG`` (a frozen dataclass) and ``run(runtime, config)``;
``NEEDS_GPU = False`` marks one that runs without a GPU (it gets a host-only runtime)."""

import os

from . import bench, bringup, run, stress

JOBS = {"bench": bench, "bringup": bringup, "run": run, "stress": stress}

# The launcher's own tests add a job that misbehaves on purpose (no GPU needed).
if os.environ.get("CHUNKRING_TEST_JOBS") == "1":
    from . import fault

    JOBS["fault"] = fault

__all__ = ["JOBS"]
