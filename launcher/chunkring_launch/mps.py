"""A private MPS control daemon for one job (``--mps``): started in temporary directories before the ranks,
told to quit however the job ends. No GPU setting changes."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from chunkring.errors import ChunkringUsageError

from .supervise import PREFIX

__all__ = ["private_mps"]


@contextlib.contextmanager
def private_mps(environ: dict[str, str], *, dry_run: bool) -> Iterator[None]:
    """Run an MPS control daemon in private directories for the job's lifetime (no GPU setting changes).
    It serves this node's ranks; on other nodes of a multi-node job start one there the same way.
    The daemon is told to quit however the job ends (the launcher catches SIGINT, SIGTERM, SIGHUP and SIGQUIT
    meanwhile), and its directories are removed, but for the log of a daemon that failed (named on stderr).
    A dry run refuses the same (no control command: ``ChunkringUsageError``) and starts nothing."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise ChunkringUsageError("needs nvidia-cuda-mps-control on PATH (part of the NVIDIA driver)",
                                  field="--mps")
    if dry_run:
        environ.update(CUDA_MPS_PIPE_DIRECTORY="<private temp dir>", CUDA_MPS_LOG_DIRECTORY="<private temp dir>")
        yield
        return
    pipe, logs = tempfile.mkdtemp(prefix="chunkring-mps-pipe-"), tempfile.mkdtemp(prefix="chunkring-mps-log-")
    environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    try:
        subprocess.run([control, "-d"], env=environ, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(pipe, ignore_errors=True)  # the log stays: it says why the daemon failed
        raise ChunkringUsageError(f"the MPS daemon did not start ({exc}); its log: {logs}", field="--mps") from None
    try:
        yield
    finally:
        quit_status = _stop_mps(control, environ)
        if quit_status is not None:  # None: still running, and its pipe directory is how to stop it
            shutil.rmtree(pipe, ignore_errors=True)
            if quit_status == 0:
                shutil.rmtree(logs, ignore_errors=True)
            else:
                print(f"{PREFIX}the MPS daemon was gone at the end of the job (it failed?); its log: {logs}",
                      file=sys.stderr)


def _stop_mps(control: str, environ: dict[str, str]) -> int | None:
    """Tell the daemon to quit: the control command's status, or None if it did not answer in time."""
    try:
        return subprocess.run([control], input=b"quit\n", env=environ, check=False, timeout=60).returncode
    except subprocess.TimeoutExpired:
        print(f"{PREFIX}the MPS daemon did not quit within 60 s; stop it with: "
              f"CUDA_MPS_PIPE_DIRECTORY={environ['CUDA_MPS_PIPE_DIRECTORY']} {control} <<< quit; "
              f"its log: {environ['CUDA_MPS_LOG_DIRECTORY']}", file=sys.stderr)
        return None
