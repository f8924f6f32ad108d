"""The fault matrix's kill cells (issue: fail closed): one rank SIGKILLed at each phase of a MoE layer's life -
its first call, a streamed call, a CUDA-graph replay, the reset, the destroy - while every other rank goes on
into that phase and waits for it there. Driven through ``chunkring-launch --np 4 --mps`` (the launcher's
``layer_fault`` job): the job must end with status 5 within KILL_ENDS_WITHIN_S, naming the killed rank once,
and leave no process of the job and no MPS daemon behind. Run outside mpirun (the launcher starts its own), with
no MPS daemon already up (scripts/gpu_suite.sh's ``faults_mps`` part stops the suite's before it)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from chunkring_launch import exitcodes
from chunkring_launch.jobs.layer_fault import PHASES
from tests.helpers.processes import live_mps_daemons, processes_with

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")]

RANKS, KILLED = 4, 1
#: Start-up (NVSHMEM, kernels from the cache, the layer), the phases before the kill, Open MPI's reaction.
KILL_ENDS_WITHIN_S = 120
#: A small bf16 layer (no DeepGEMM): 2 experts per rank, five chunks of 8 through a two-slot ring.
LAYER = ["payload=\"bf16\"", "num_experts=8", "hidden=256", "intermediate=128", "topk=2", "max_tokens_per_rank=40",
         "stream_slots=2", "stream_slot_tokens=8", "tokens_per_rank=37"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_rank_killed_ends_the_job_naming_it_and_leaves_nothing_behind(phase, record_testsuite_property):
    # A short TMPDIR: the launcher's MPS daemon puts its sockets below it, and a socket path has 107 bytes at most.
    tmp_path = Path(tempfile.mkdtemp(prefix="crk-", dir="/tmp"))
    config = tmp_path / "layer_fault.toml"
    config.write_text('job = "layer_fault"\n')
    argv = [sys.executable, "-m", "chunkring_launch.cli", "--np", str(RANKS), "--mps", "--no-progress",
            "--timeout", str(KILL_ENDS_WITHIN_S + 60), "--config", str(config), "layer_fault", f"phase={phase}",
            f"rank={KILLED}", *LAYER]
    env = dict(os.environ, CHUNKRING_TEST_JOBS="1", TMPDIR=str(tmp_path))
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=KILL_ENDS_WITHIN_S + 120,
                          check=False)
    took = time.monotonic() - start
    record_testsuite_property(f"kill_{phase}_s", round(took, 1))
    assert proc.returncode == exitcodes.RANK_DIED, proc.stderr[-4000:]
    assert proc.stderr.count(f"chunkring-launch: rank {KILLED} ") == 1, proc.stderr[-4000:]
    assert "signal 9" in proc.stderr, proc.stderr[-4000:]
    assert took < KILL_ENDS_WITHIN_S
    time.sleep(1.0)  # Open MPI's and the launcher's last children need a moment to be reaped
    assert processes_with(str(tmp_path), count_zombies=False) == [], "a process of the job outlived it"
    assert live_mps_daemons() == [], "an MPS daemon outlived the job"
