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
    The daemon is told to quit however the job ends (the launcher catches SIGINT/SIGTERM meanwhile)."""
    if dry_run:
        environ.update(CUDA_MPS_PIPE_DIRECTORY="<private temp dir>", CUDA_MPS_LOG_DIRECTORY="<private temp dir>")
        yield
        return
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise ChunkringUsageError("--mps needs nvidia-cuda-mps-control on PATH", field="--mps")
    pipe, logs = tempfile.mkdtemp(prefix="chunkring-mps-pipe-"), tempfile.mkdtemp(prefix="chunkring-mps-log-")
    environ.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    try:
        subprocess.run([control, "-d"], env=environ, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ChunkringUsageError(f"the MPS daemon did not start ({exc}); its log: {logs}", field="--mps") from None
    try:
        yield
    finally:
        _stop_mps(control, environ)


def _stop_mps(control: str, environ: dict[str, str]) -> None:
    try:
        subprocess.run([control], input=b"quit\n", env=environ, check=False, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"{PREFIX}the MPS daemon did not quit within 60 s; stop it with: "
              f"CUDA_MPS_PIPE_DIRECTORY={environ['CUDA_MPS_PIPE_DIRECTORY']} {control} <<< quit", file=sys.stderr)
