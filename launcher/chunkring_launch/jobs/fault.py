"""A job that needs no GPU and misbehaves on purpose: the launcher's own tests drive real mpirun
processes with it (a rank that raises, hangs, is SIGKILLed, or exits). Registered only when
``CHUNKRING_TEST_JOBS=1``; it has no preset, so give it one with ``--config FILE.toml``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkring.errors import UsageProblems

from ..config import CheckedConfig, check_range
from ..progress import progress

if TYPE_CHECKING:
    from chunkring.hostcomm import HostComm

NEEDS_GPU = False
BEHAVIOURS = ("pass", "raise", "hang", "kill", "exit")


@dataclass(frozen=True)
class CONFIG(CheckedConfig):
    behaviour: str = "pass"
    rank: int = 1            # the rank that misbehaves; -1: every rank does
    iterations: int = 3      # barrier-separated steps before it misbehaves (progress reports)
    step_s: float = 0.05

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        if self.behaviour not in BEHAVIOURS:
            problems.add(f"must be one of {list(BEHAVIOURS)}, got {self.behaviour!r}", field="behaviour")
        if self.rank < -1:
            problems.add(f"must be a rank or -1 (every rank), got {self.rank}", field="rank")
        check_range(problems, self, "iterations", 0, 10_000)
        check_range(problems, self, "step_s", 0, 60)


def run(runtime: HostComm, config: CONFIG) -> dict[str, int]:
    bar = progress("fault", runtime.rank, total=config.iterations)
    for done in range(1, config.iterations + 1):
        time.sleep(config.step_s)
        runtime.barrier()
        bar.update(done)
    bar.close(config.iterations)
    if config.rank in (-1, runtime.rank):
        _misbehave(config.behaviour, runtime.rank)
    runtime.barrier()  # the other ranks wait here for the one that misbehaves
    return {"iterations": config.iterations}


def _misbehave(behaviour: str, rank: int) -> None:
    if behaviour == "raise":
        raise RuntimeError(f"deliberate failure on rank {rank}")
    if behaviour == "hang":
        time.sleep(3600)
    if behaviour == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "exit":
        os._exit(3)  # without MPI_Finalize or a diagnostic
