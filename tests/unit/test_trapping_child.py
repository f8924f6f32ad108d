"""tests/helpers/processes.py's run_trapping_child, without a GPU: the child it starts from a rank of an ``mpirun`` job
is a job of one rank (chunkring reads no launcher variable there) and finds no MPS daemon."""

from tests.helpers.processes import run_trapping_child

CHILD = """
import os
from chunkring.ranks import RankInfo
print(RankInfo.from_env())
print(sorted(os.listdir(os.environ["CUDA_MPS_PIPE_DIRECTORY"])))
"""


def test_a_child_of_a_rank_is_a_job_of_one_outside_mps(monkeypatch, tmp_path):
    job = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "2", "PMI_RANK": "2", "PMI_SIZE": "4"}
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "control").touch()  # the job's daemon pipe, which the child must not see
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    done = run_trapping_child(CHILD, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)", "[]"]
