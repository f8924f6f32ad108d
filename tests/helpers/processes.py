"""Processes a test's job may have left behind, read from /proc (Linux), and a child that must run outside MPS."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["live_mps_daemons", "processes_with", "run_trapping_child", "zombie"]


def processes_with(needle: str, *, count_zombies: bool = True) -> list[int]:
    """Processes other than this one with ``needle`` in their environment (a job's directory: its ranks, the
    launcher's MPS daemon); zombies too unless ``count_zombies`` is False (one that init has yet to reap)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in (entry / "environ").read_bytes() and (count_zombies or not zombie(entry)):
                    alive.append(int(entry.name))
            except OSError:
                continue
    return alive


def live_mps_daemons() -> list[int]:
    """MPS daemon processes (control and server) that are not zombies."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith("nvidia-cuda-mps") and not zombie(entry):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def zombie(entry: Path) -> bool:
    """Whether the process of ``/proc/<pid>`` has exited and waits to be reaped."""
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


#: Prefixes of what a launcher (Open MPI, PMIx, MPICH/Hydra) tells its ranks: a child that kept them would take itself
#: for one of the job's ranks and wait for peers that never join it.
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "HYDRA_")


def run_trapping_child(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child whose kernel is meant to trap, on a context of its own, as a job of one rank.

    Under MPS a trap in one client ends the context of every client on the GPU (the other ranks, and this test's
    own process), so the child gets an empty MPS pipe directory: its driver finds no control daemon there and
    creates a plain context, which the trap ends alone. Started from a rank of an ``mpirun`` job, it leaves the
    launcher's variables behind (:data:`LAUNCHER_PREFIXES`)."""
    with tempfile.TemporaryDirectory(prefix="no-mps-") as pipes:
        env = {name: value for name, value in os.environ.items() if not name.startswith(LAUNCHER_PREFIXES)}
        env.update(CUDA_MPS_PIPE_DIRECTORY=pipes, CUDA_MPS_LOG_DIRECTORY=pipes)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              check=False, env=env)
