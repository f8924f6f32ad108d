"""How the launcher turns the end of a job into one exit status and one message (no processes run)."""

import signal

from chunkring_launch import exitcodes
from chunkring_launch.jobdir import record_failure
from chunkring_launch.supervise import Outcome, conclude, dead_rank

OMPI_KILLED = """--------------------------------------------------------------------------
prterun noticed that process rank 3 with PID 3987 on node gpu7 exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
OMPI_EXITED = """prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-6104@1,2]
   Exit code:    3
"""
OMPI_TIMEOUT = "The user-provided time limit for job execution has been reached:\n\n  Timeout: 5 seconds\n"


def test_passed(tmp_path):
    assert conclude(Outcome(0, 1.0), job_dir=tmp_path, timeout_s=5) == (exitcodes.PASSED, [], False)


def test_interrupted_wins_over_everything(tmp_path):
    status, lines, _ = conclude(Outcome(1, 1.0, signal=signal.SIGINT, stderr_tail=OMPI_KILLED), job_dir=tmp_path,
                                timeout_s=5)
    assert status == 130 and lines == ["chunkring-launch: interrupted by SIGINT: every rank was ended"]
    assert conclude(Outcome(1, 1.0, signal=signal.SIGTERM), job_dir=tmp_path, timeout_s=5)[0] == 143


def test_timeout_from_open_mpi_or_our_deadline(tmp_path):
    for outcome in (Outcome(241, 5.1, stderr_tail=OMPI_TIMEOUT), Outcome(-15, 5.1, deadline_hit=True)):
        status, lines, keep = conclude(outcome, job_dir=tmp_path, timeout_s=5)
        assert status == exitcodes.TIMED_OUT and "ran past --timeout 5 s" in lines[0] and not keep
    (tmp_path / "rank1.stack").write_text("Current thread ...\n")
    status, lines, keep = conclude(Outcome(241, 5.1, stderr_tail=OMPI_TIMEOUT), job_dir=tmp_path, timeout_s=5)
    assert "(ranks 1)" in lines[1] and keep


def test_first_failure_is_shown_once(tmp_path):
    assert record_failure(tmp_path, 2, "chunkring-launch: rank 2: RuntimeError: boom\n")
    assert not record_failure(tmp_path, 0, "chunkring-launch: rank 0: RuntimeError: boom\n")
    # Printed by the rank itself: not repeated; the other failing rank is pointed at.
    status, lines, keep = conclude(Outcome(1, 1.0, stderr_tail="chunkring-launch: rank 2: RuntimeError: boom\n"),
                                   job_dir=tmp_path, timeout_s=5)
    assert status == exitcodes.FAILED and len(lines) == 1 and "rank(s) 0 failed too" in lines[0] and keep
    # Lost in the abort: printed from the job directory.
    _, lines, _ = conclude(Outcome(1, 1.0), job_dir=tmp_path, timeout_s=5)
    assert lines[0] == "chunkring-launch: rank 2: RuntimeError: boom"


def test_a_dead_rank_is_named(tmp_path):
    status, lines, _ = conclude(Outcome(137, 1.0, stderr_tail=OMPI_KILLED), job_dir=tmp_path, timeout_s=5)
    assert status == exitcodes.RANK_DIED
    assert lines == [("chunkring-launch: rank 3 (on gpu7) was killed by signal 9 (SIGKILL) without reporting an "
                      "error; the job was ended")]
    assert dead_rank(Outcome(3, 1.0, stderr_tail=OMPI_EXITED))[0] == 2
    assert dead_rank(Outcome(-9, 1.0)) == (0, "was killed by signal 9 (SIGKILL) without reporting an error")


def test_unexplained_failure(tmp_path):
    status, lines, _ = conclude(Outcome(7, 1.0), job_dir=tmp_path, timeout_s=5)
    assert status == exitcodes.FAILED and "status 7" in lines[0]


def test_a_single_worker_exiting_without_a_word_is_a_dead_rank(tmp_path):
    # Under mpirun Open MPI's notice names the rank (status 5); a lone worker's own status must give the same.
    status, lines, _ = conclude(Outcome(3, 1.0), job_dir=tmp_path, timeout_s=5, single_worker=True)
    assert status == exitcodes.RANK_DIED
    assert lines == ["chunkring-launch: rank 0 exited with status 3 without reporting an error; the job was ended"]
