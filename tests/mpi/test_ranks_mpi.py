"""Under mpirun, every rank's RankInfo agrees with MPI, and ranks and node-local ranks are distinct."""

import pytest

from chunkring import RankInfo


@pytest.mark.mpi(min_size=2)
def test_rank_info_matches_mpi():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    info = RankInfo.from_env()
    assert (info.rank, info.world_size) == (comm.Get_rank(), comm.Get_size())
    everyone = comm.allgather(info)
    assert sorted(i.rank for i in everyone) == list(range(comm.Get_size()))
    assert len({i.local_rank for i in everyone}) == info.local_world_size  # one node here
    assert all(i.single_node for i in everyone)
