"""RankInfo reads Open MPI and MPICH variables, and rejects inconsistent ones with the field named."""

import pytest

from chunkring import RankInfo
from chunkring.errors import ChunkringUsageError


def test_no_launcher_is_single_process():
    assert RankInfo.from_env({}) == RankInfo(0, 1, 0, 1)


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    info = RankInfo.from_env(env)
    assert info == RankInfo(5, 16, 1, 8)
    assert not info.single_node


def test_mpich_without_local_vars_assumes_one_node():
    info = RankInfo.from_env({"PMI_RANK": "2", "PMI_SIZE": "4"})
    assert info == RankInfo(2, 4, 2, 4) and info.single_node


@pytest.mark.parametrize("args,field", [((4, 4, 0, 1), "rank"), ((0, 2, 2, 2), "local_rank"),
                                        ((0, 2, 0, 4), "local_world_size"), ((0, 0, 0, 1), "rank")])
def test_inconsistent(args, field):
    with pytest.raises(ChunkringUsageError) as info:
        RankInfo(*args)
    assert info.value.field == field


def test_non_integer():
    with pytest.raises(ChunkringUsageError) as info:
        RankInfo.from_env({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"})
    assert info.value.field == "OMPI_COMM_WORLD_RANK"
