"""Exit status of ``chunkring-launch`` (also documented in its ``--help`` and docs/LAUNCHER.md)."""

import signal

PASSED = 0
#: A rank raised: its diagnostic was printed once and the job was aborted.
FAILED = 1
#: Bad usage, config or setup (no mpirun, an MPS daemon that did not start), reported before any rank started.
USAGE = 2
#: The job needs a GPU and none is visible (``chunkring-launch doctor`` too, when it finds no GPU).
NO_GPU = 3
#: The job ran past ``--timeout`` (a rank hung, or the limit is too short); every rank was ended.
TIMED_OUT = 4
#: A rank died without reporting (killed by a signal, or exited on its own); the others were ended.
RANK_DIED = 5


def interrupted(signum: int) -> int:
    """The shell's convention for a job ended by a signal: 130 for SIGINT (Ctrl-C), 143 for SIGTERM."""
    return 128 + signum


INTERRUPTED = interrupted(signal.SIGINT)
