"""The job directory the launcher shares with its ranks (``CHUNKRING_JOB_DIR``): each failing rank's
diagnostic, which rank failed first, and every rank's Python stack if the job was ended from outside.

A directory on one node's file system: on a multi-node job each node has its own, so each node's first
failing rank prints its diagnostic.
"""

from __future__ import annotations

import os
from pathlib import Path

JOB_DIR_VAR = "CHUNKRING_JOB_DIR"
_FIRST = "first_failure"


def diagnostic_path(job_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(job_dir) / f"rank{rank}.txt"


def stack_path(job_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(job_dir) / f"rank{rank}.stack"


def record_failure(job_dir: str | os.PathLike[str], rank: int, text: str) -> bool:
    """Write ``rank``'s diagnostic; True if this rank is the first of the job to fail (it alone prints)."""
    path = diagnostic_path(job_dir, rank)
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)  # whole or absent, for a launcher reading while ranks are killed
    try:
        fd = os.open(Path(job_dir) / _FIRST, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(str(rank))
    return True


def first_failure(job_dir: str | os.PathLike[str]) -> int | None:
    """The rank that recorded the first failure, or None."""
    try:
        return int((Path(job_dir) / _FIRST).read_text())
    except (FileNotFoundError, ValueError):
        return None


def failed_ranks(job_dir: str | os.PathLike[str]) -> list[int]:
    """Every rank that recorded a diagnostic, ascending."""
    return sorted(int(p.stem[4:]) for p in Path(job_dir).glob("rank*.txt") if p.stem[4:].isdigit())


def ranks_with_stacks(job_dir: str | os.PathLike[str]) -> list[int]:
    """Ranks whose Python stack was dumped when they were ended from outside (non-empty stack files)."""
    return sorted(int(p.stem[4:]) for p in Path(job_dir).glob("rank*.stack")
                  if p.stem[4:].isdigit() and p.stat().st_size > 0)
