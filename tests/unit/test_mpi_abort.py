"""The MPI test harness ends a job in seconds when one rank fails while its peers wait in a collective."""

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAILING_TEST = textwrap.dedent('''
    import pytest

    @pytest.mark.mpi(min_size=2)
    def test_one_rank_fails_the_other_waits():
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.Get_rank() == 1:
            assert False, "deliberate failure on rank 1"
        comm.barrier()  # rank 0 would wait here forever without the abort hook
''')


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_failing_rank_aborts_the_job(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_fail.py").write_text(FAILING_TEST)
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--timeout", "120"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "aborting the MPI job" in output, output
    assert elapsed < 60, f"took {elapsed:.0f} s: the abort hook did not end the job"
