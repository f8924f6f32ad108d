"""A machine as ``chunkring-launch`` sees it before it starts anything, for the tests of its checks and its dry
run (tests/unit/test_launcher.py, test_cli.py): how many GPUs the driver shows, which of the tools it looks up on
PATH (``mpirun``, ``nvidia-cuda-mps-control``) exist, and a hostfile in the working directory. The tools are
stand-ins that fail if run: a dry run only looks them up."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from chunkring_launch import cli

__all__ = ["TOOLS", "stand_in_machine", "stand_in_tools"]

#: The tools a launch looks up on PATH.
TOOLS = ("mpirun", "nvidia-cuda-mps-control")


def stand_in_tools(bin_dir: Path, tools: Iterable[str] = TOOLS) -> Path:
    """``bin_dir`` (made if missing) holding a stand-in of each of ``tools`` that fails if run; returns ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\necho 'a stand-in: not to be run' >&2\nexit 99\n")
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def stand_in_machine(monkeypatch: pytest.MonkeyPatch, folder: Path, *, gpus: int = 4,
                     tools: Iterable[str] = TOOLS) -> Path:
    """``gpus`` GPUs (the driver's count and torch's), only ``tools`` on PATH (:func:`stand_in_tools`), and
    ``folder`` the working directory, holding a hostfile ``hosts``; returns ``folder``."""
    monkeypatch.setenv("PATH", str(stand_in_tools(folder / "bin", tools)))
    monkeypatch.setattr(cli, "driver_gpu_count", lambda: gpus)
    monkeypatch.setattr(cli, "torch_gpu_count", lambda: gpus)  # what a launch asks when the driver shows some
    (folder / "hosts").write_text("localhost slots=16\n")
    monkeypatch.chdir(folder)
    return folder
