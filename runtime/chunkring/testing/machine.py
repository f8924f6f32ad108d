"""What machine a result was measured on, for the result files tests, benchmarks and the launcher write
(tests/gpu_results/README.md): the NVIDIA driver's version, read from ``nvidia-smi``."""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["driver_version", "query_driver_version"]


def query_driver_version(smi: str) -> str | None:
    """What ``smi`` (nvidia-smi) prints as the first GPU's driver version, or None if nothing; raises
    OSError / SubprocessError if it cannot run."""
    text = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30).stdout.split()
    return text[0] if text else None


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi prints it (e.g. 580.159.04), or None where nvidia-smi is
    missing, fails or prints nothing: for result files, which record the machine they ran on."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return query_driver_version(smi)
    except (OSError, subprocess.SubprocessError):
        return None
