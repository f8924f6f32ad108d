"""The launcher's multi-rank host logic across real ranks (mpirun -np 2 / -np 4, no GPU).

* Config identity: every rank builds the same MoE layer config from the same preset and overrides, and
  the collective constructors' check (``check_identical``, here over mpi4py's allgather) passes for
  it and fails every rank alike when one rank's config differs.
* ``chunkring-launch JOB`` inside an MPI job: a config that does not fit the job's rank count is refused
  on every rank with status 2 before any GPU work, no GPU is status 3 on every rank, and a host-only job
  runs on every rank with rank 0 printing one table of every rank's figures.
* The job directory's first-failure claim is won by exactly one of the ranks failing at once.
* A launcher started with as many ranks as this MPI job (by rank 0; the others wait without spinning)
  ends the whole job with one diagnostic when a rank raises (1), names a SIGKILLed rank (5), and ends
  every rank on Ctrl-C (130).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat
from chunkring_launch import cli, exitcodes
from chunkring_launch.config import from_table, load_table, parse_overrides
from chunkring_launch.jobdir import failed_ranks, first_failure, record_failure
from chunkring_launch.jobs import JOBS, fault
from tests.helpers.devices import HAVE_GPU
from tests.helpers.processes import processes_with


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _mpi_runtime(comm):
    """What ``check_identical`` needs of a runtime, straight from mpi4py (no GPU, no chunkring.init)."""
    return SimpleNamespace(rank=comm.Get_rank(), world_size=comm.Get_size(), allgather_object=comm.allgather)


def _wait_for_everyone(comm) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave the CPUs to rank 0's children."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.05)


def _layer_config(job: str, overrides=()) -> MoEConfig:
    table = {**load_table(job), **parse_overrides(overrides)}
    return from_table(JOBS[job].CONFIG, table, job=job).layer_config()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("job", ["run", "stress", "bench"])
def test_every_rank_builds_the_same_layer_config(job):
    from chunkring.ring.ring import check_identical

    comm = _comm()
    cfg = _layer_config(job, ["topk=2"])
    assert comm.allgather(cfg) == [cfg] * comm.Get_size()
    check_identical(_mpi_runtime(comm), cfg)  # passes on every rank
    cfg.check_world_size(comm.Get_size())      # the presets fit 2 and 4 ranks


@pytest.mark.mpi(min_size=2)
def test_equivalent_spellings_agree_and_a_different_config_fails_every_rank():
    from chunkring.ring.ring import check_identical

    comm = _comm()
    rank, runtime = comm.Get_rank(), _mpi_runtime(comm)
    base = dict(num_experts=4 * comm.Get_size(), hidden=256, intermediate=128, topk=2, max_tokens_per_rank=64)
    # The payload as a member on one rank and as its int value on another: the same config.
    mine = MoEConfig(**base, payload=PayloadFormat.BF16 if rank % 2 else int(PayloadFormat.BF16)).with_default_ring()
    check_identical(runtime, mine)
    # The last rank streams through a different ring: every rank must refuse, none may hang.
    if rank == comm.Get_size() - 1:
        mine = replace(mine, stream_slots=mine.stream_slots + 1)
    with pytest.raises(ChunkringUsageError, match="ranks disagree"):
        check_identical(runtime, mine)
    comm.Barrier()  # every rank refused alike; the world is still usable


@pytest.mark.mpi(min_size=2)
def test_a_config_that_does_not_fit_the_rank_count_is_refused_on_every_rank(capsys):
    comm = _comm()
    experts = 4 * comm.Get_size() + 1  # never divisible by 2 or 4
    status = cli.main(["run", f"num_experts={experts}"])
    assert comm.allgather(status) == [exitcodes.USAGE] * comm.Get_size()
    err = capsys.readouterr().err
    assert err.count(f"{experts} experts do not split evenly over {comm.Get_size()} ranks") == 1, err
    assert "Traceback" not in err


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(HAVE_GPU, reason="checks the no-GPU path")
def test_no_gpu_is_status_3_on_every_rank(capsys):
    comm = _comm()
    status = cli.main(["run"])
    assert comm.allgather(status) == [exitcodes.NO_GPU] * comm.Get_size()
    assert "no CUDA GPU is visible" in capsys.readouterr().err


@pytest.mark.mpi(min_size=2)
def test_a_host_job_runs_on_every_rank_and_rank_0_reports(tmp_path, monkeypatch, capsys):
    comm = _comm()
    monkeypatch.setitem(JOBS, "fault", fault)  # the CPU-only test job (CHUNKRING_TEST_JOBS=1 registers it)
    config = tmp_path / "fault.toml"
    config.write_text('job = "fault"\n')
    status = cli.main(["--config", str(config), "fault", "iterations=2", "step_s=0.01"])
    assert comm.allgather(status) == [exitcodes.PASSED] * comm.Get_size()
    out = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert f"chunkring fault: PASS on {comm.Get_size()} rank(s)" in out, out
        assert all(f"rank {r}" in out for r in range(comm.Get_size())), out
    else:
        assert "PASS" not in out, out


@pytest.mark.mpi(min_size=2)
def test_exactly_one_rank_claims_the_first_failure():
    comm = _comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    job_dir = comm.bcast(tempfile.mkdtemp(prefix="chunkring-job-") if rank == 0 else None)
    comm.Barrier()
    first = record_failure(job_dir, rank, f"chunkring-launch: rank {rank}: deliberate\n")
    winners = [r for r, won in enumerate(comm.allgather(first)) if won]
    assert len(winners) == 1
    comm.Barrier()
    assert first_failure(job_dir) == winners[0]
    assert failed_ranks(job_dir) == list(range(size))
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(job_dir)


# ----------------------------------------------------------------------- a launcher of this world's size

def _launcher_env(tmp_path) -> dict:
    """This rank's environment without the MPI job's own variables, so the launcher's mpirun starts
    a job of its own; the job directory lands in ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    return dict(env, CHUNKRING_TEST_JOBS="1", TMPDIR=str(tmp_path))


def _launcher_argv(tmp_path, ranks: int, *overrides, timeout: int = 90) -> list[str]:
    config = tmp_path / "fault.toml"
    config.write_text('job = "fault"\n')
    return [sys.executable, "-m", "chunkring_launch.cli", "--np", str(ranks), "--timeout", str(timeout),
            "--no-progress", "--config", str(config), "fault", *overrides]


def _on_rank_0(comm, action):
    """``action()`` on rank 0 while the others wait without spinning; its result on every rank."""
    result = action() if comm.Get_rank() == 0 else None
    _wait_for_everyone(comm)
    return comm.bcast(result)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("behaviour, status, needle", [
    ("raise", exitcodes.FAILED, "RuntimeError: deliberate failure on rank {last}"),
    ("kill", exitcodes.RANK_DIED, "chunkring-launch: rank {last} "),
], ids=["raise", "kill"])
def test_a_failing_rank_of_a_launch_this_wide_ends_it(tmp_path, behaviour, status, needle):
    comm = _comm()
    size = comm.Get_size()

    def launch():
        start = time.monotonic()
        proc = subprocess.run(_launcher_argv(tmp_path, size, f"behaviour={behaviour}", f"rank={size - 1}"),
                              env=_launcher_env(tmp_path), capture_output=True, text=True, timeout=180)
        return proc.returncode, proc.stderr, time.monotonic() - start

    returncode, stderr, elapsed = _on_rank_0(comm, launch)
    assert returncode == status, stderr
    assert stderr.count(needle.format(last=size - 1)) == 1, stderr
    assert elapsed < 60, f"{elapsed:.0f} s"


@pytest.mark.mpi(min_size=2)
def test_ctrl_c_ends_every_rank_of_a_launch_this_wide(tmp_path):
    comm = _comm()
    size = comm.Get_size()

    def interrupt():
        proc = subprocess.Popen(_launcher_argv(tmp_path, size, "behaviour=hang", "rank=-1", "iterations=0"),
                                env=_launcher_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("chunkring-job-*/rank*.stack"))) < size:  # every worker started
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                return None, proc.communicate()[1], 0.0, []
            time.sleep(0.2)
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        return proc.returncode, stderr, time.monotonic() - start, processes_with(str(tmp_path))

    returncode, stderr, elapsed, alive = _on_rank_0(comm, interrupt)
    assert returncode == exitcodes.INTERRUPTED, stderr
    assert stderr.count("interrupted by SIGINT") == 1, stderr
    assert elapsed < 15, f"{elapsed:.0f} s"  # the grace period is 10 s
    assert alive == []
