"""Jobs that ``chunkring-launch`` runs. Each exposes ``CONFIG`` (a frozen dataclass) and ``run(runtime, config)``."""

from . import bringup, run

JOBS = {"bringup": bringup, "run": run}

__all__ = ["JOBS"]
