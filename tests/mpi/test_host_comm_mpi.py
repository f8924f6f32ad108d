"""Host collectives across real ranks (mpirun, no GPU): HostComm and a Runtime built without one
(its collectives need no GPU), and the library code that goes through them - the collective
constructors' argument check and the calibration's agreement on one decision."""

import os
import tempfile
import time
from pathlib import Path

import pytest

from chunkring import ChunkringHostTimeoutError, ChunkringOutOfStepError, ChunkringUsageError, RankInfo, Runtime
from chunkring.hostcomm import HostComm


def _world():
    comm = HostComm.from_env()
    return comm, comm.rank, comm.world_size


@pytest.mark.mpi(min_size=2)
def test_allgather_in_rank_order_everywhere():
    comm, rank, size = _world()
    everyone = comm.allgather_object({"rank": rank, "payload": [rank] * rank})
    assert everyone == [{"rank": r, "payload": [r] * r} for r in range(size)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("root", ["first", "last"])
def test_gather_to_any_root(root):
    comm, rank, size = _world()
    root = 0 if root == "first" else size - 1
    got = comm.gather_object((rank, f"from {rank}"), root=root)
    assert got == ([(r, f"from {r}") for r in range(size)] if rank == root else None)


@pytest.mark.mpi(min_size=2)
def test_broadcast_from_a_root_other_than_zero():
    comm, rank, size = _world()
    root = size - 1
    got = comm.broadcast_object({"go": True, "sent_by": rank} if rank == root else None, root=root)
    assert got == {"go": True, "sent_by": root}


@pytest.mark.mpi(min_size=2)
def test_barrier_orders_the_ranks():
    comm, rank, size = _world()
    folder = Path(comm.broadcast_object(tempfile.mkdtemp(prefix="chunkring-barrier-") if rank == 0 else None))
    (folder / f"rank{rank}").write_text("here")
    comm.barrier()
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"rank{r}" for r in range(size))
    comm.barrier()  # nobody removes the folder before every rank has looked
    if rank == 0:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


@pytest.mark.mpi(min_size=2)
def test_a_barrier_with_a_limit_names_the_absent_rank_and_stays_in_step():
    """The ranks that came raise once the limit passes, naming the rank that did not; the late rank raises too,
    naming who gave up, instead of passing a barrier they abandoned; the next collectives line up."""
    comm, rank, size = _world()
    late = size - 1
    if rank == late:
        time.sleep(1.5)  # past the others' limit
        with pytest.raises(ChunkringHostTimeoutError) as info:
            comm.barrier(timeout_s=60, what="the test's barrier")
        assert info.value.absent_ranks == () and info.value.gave_up_ranks
        assert set(info.value.gave_up_ranks) <= set(range(late))
    else:
        with pytest.raises(ChunkringHostTimeoutError, match="within 0.3 s") as info:
            comm.barrier(timeout_s=0.3, what="the test's barrier")
        assert info.value.absent_ranks == (late,) and info.value.what == "the test's barrier"
        assert f"rank(s) {late} did not reach the test's barrier" in str(info.value)
    assert comm.allgather_object(rank) == list(range(size))
    comm.barrier(timeout_s=60)  # and a bounded barrier that every rank reaches returns
    comm.barrier(timeout_s=60)


@pytest.mark.mpi(min_size=2)
def test_ranks_at_different_collectives_raise_on_every_rank_and_stay_in_step():
    """The last rank is at another collective than the others (it skipped one they made): every rank raises
    ChunkringOutOfStepError naming what the others are at, and the barrier after it lines up."""
    comm, rank, size = _world()
    odd = size - 1
    mine = "the ring's close()" if rank == odd else "an allgather"
    with pytest.raises(ChunkringOutOfStepError) as info:
        comm.barrier(timeout_s=60, what=mine)
    expected = {r: "an allgather" for r in range(odd)} if rank == odd else {odd: "the ring's close()"}
    assert info.value.what == mine and info.value.elsewhere == expected
    comm.barrier(timeout_s=60, what="the rejoin")
    assert comm.allgather_object(rank) == list(range(size))


@pytest.mark.mpi(min_size=2)
def test_a_rank_info_that_disagrees_with_mpi_is_refused_before_any_collective():
    _, rank, size = _world()
    wrong = HostComm(RankInfo((rank + 1) % size, size, (rank + 1) % size, size))
    with pytest.raises(ChunkringUsageError) as info:
        wrong.allgather_object(rank)
    assert info.value.field == "rank_info"
    HostComm.from_env().barrier()  # every rank refused alike; the world is still usable


@pytest.mark.mpi(min_size=2)
def test_a_runtime_without_a_gpu_runs_the_same_collectives():
    info = RankInfo.from_env()
    rt = Runtime(ranks=info, ordinal=0, device=None)  # never init()ed: no CUDA, no NVSHMEM
    assert rt.allgather_object(info.rank * 10) == [r * 10 for r in range(info.world_size)]
    assert rt.broadcast_object("root's" if info.rank == 0 else "mine") == "root's"
    got = rt.gather_object(info.rank, root=0)
    assert got == (list(range(info.world_size)) if info.rank == 0 else None)


@pytest.mark.mpi(min_size=2)
def test_collective_constructors_fail_every_rank_alike_on_disagreement():
    from chunkring.ring.ring import check_identical

    info = RankInfo.from_env()
    rt = Runtime(ranks=info, ordinal=0, device=None)
    check_identical(rt, ("spec", 2, 1.5))  # the same everywhere: passes
    with pytest.raises(ChunkringUsageError, match="ranks disagree") as exc:
        check_identical(rt, ("spec", 2, 1.5 if info.rank == 0 else 9.0))
    assert exc.value.field == "spec"


@pytest.mark.mpi(min_size=2)
def test_calibration_agrees_on_the_slowest_ranks_figures():
    from chunkring.moe.calibration import slowest_rank

    info = RankInfo.from_env()
    rt = Runtime(ranks=info, ordinal=0, device=None)
    # Rank r is slowest streaming at 16 tokens when r == last, and rank 0 slowest batch-ready at 2048:
    # every rank must end up with each option's slowest figure.
    last = info.world_size - 1
    mine = ({16: 1.0, 2048: 9.0 + (info.rank == 0)}, {16: {16: 1.0 + 0.1 * (info.rank + 1)}, 2048: {512: 9.0}})
    agreed = slowest_rank(rt.allgather_object(mine))
    assert agreed == ({16: 1.0, 2048: 10.0}, {16: {16: 1.0 + 0.1 * (last + 1)}, 2048: {512: 9.0}})
    assert rt.allgather_object(agreed) == [agreed] * info.world_size


@pytest.mark.mpi(min_size=2)
def test_the_environment_matches_mpi():
    from mpi4py import MPI

    comm = HostComm.from_env()
    assert (comm.rank, comm.world_size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE")) == str(comm.world_size)


@pytest.mark.mpi(min_size=2)
def test_init_counts_the_ranks_that_share_each_gpu():
    """What ``init()`` sets as ``Runtime.gpu_ranks``: the ranks on the same host reporting the same GPU UUID,
    here even ranks on one pretend GPU and odd ranks on another (all ranks on this one host)."""
    from chunkring.bringup import ranks_on_my_gpu

    comm, rank, size = _world()
    assert ranks_on_my_gpu(comm, "GPU-shared") == size
    assert ranks_on_my_gpu(comm, f"GPU-{rank % 2}") == (size + 1 - rank % 2) // 2
    assert ranks_on_my_gpu(comm, f"GPU-{rank}") == 1
