"""`chunkring-launch` on a machine without a GPU says so plainly and exits non-zero, no traceback."""

import subprocess
import sys

import pytest

from tests.conftest import HAVE_GPU


@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU path")
def test_no_gpu_message():
    proc = subprocess.run([sys.executable, "-m", "chunkring.launcher.cli", "bringup"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "no CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_unknown_job_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "chunkring.launcher.cli", "nosuchjob"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
