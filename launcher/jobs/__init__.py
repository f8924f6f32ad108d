"""Jobs that ``chunkring-launch`` runs. Each exposes ``CONFIG`` (a frozen dataclass) and ``run(runtime, config)``."""

from . import bringup

JOBS = {"bringup": bringup}

__all__ = ["JOBS"]
