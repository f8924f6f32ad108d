"""Host collectives (chunkring.hostcomm.HostComm, and the Runtime methods that use it) in a single
process: trivial, no MPI initialised, roots checked; the Runtime refuses them once closed; the callers
(check_identical, the worker's host-only runtime) go through them. tests/mpi/test_host_comm_mpi.py
runs the same collectives across ranks."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from chunkring import ChunkringUsageError, RankInfo, Runtime
from chunkring.hostcomm import HostComm
from chunkring.ring.ring import check_identical

ONE = RankInfo(0, 1, 0, 1)


def test_single_process_collectives_are_trivial():
    comm = HostComm(ONE)
    obj = {"figures": [1.5, 2.5]}
    assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.allgather_object(obj) == [obj]
    assert comm.gather_object(obj) == [obj] and comm.gather_object(obj, root=0) == [obj]
    assert comm.broadcast_object(obj) is obj
    assert comm.barrier() is None
    assert comm.abort(1) is None  # nothing to end in a single process
    assert repr(comm) == "HostComm(rank 0 of 1)"


def test_a_single_process_never_initialises_mpi():
    code = ("import sys; from chunkring.hostcomm import HostComm; c = HostComm.from_env(); "
            "c.allgather_object(1); c.gather_object(1); c.broadcast_object(1); c.barrier(); c.abort(); "
            "print(c.world_size, 'mpi4py.MPI' in sys.modules)")
    env_without_mpi = {k: v for k, v in os.environ.items()
                       if not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env_without_mpi)
    assert out.stdout.split() == ["1", "False"]


@pytest.mark.parametrize("root", [1, -1, True, 0.0, "0"])
def test_a_root_outside_the_world_is_refused(root):
    comm = HostComm(ONE)
    for call in (lambda: comm.gather_object(1, root=root), lambda: comm.broadcast_object(1, root=root)):
        with pytest.raises(ChunkringUsageError) as info:
            call()
        assert info.value.field == "root"


def test_only_a_rank_info_makes_one():
    with pytest.raises(ChunkringUsageError) as info:
        HostComm(SimpleNamespace(rank=0, world_size=1))
    assert info.value.field == "ranks"


def test_the_runtime_owns_one_and_delegates():
    rt = Runtime(ranks=ONE, ordinal=0, device=None)  # no GPU touched until alloc/barrier/close
    assert isinstance(rt.comm, HostComm) and rt.comm.ranks == ONE
    assert rt.allgather_object("x") == ["x"]
    assert rt.gather_object("x", root=0) == ["x"]
    assert rt.broadcast_object("x", root=0) == "x"
    seen = []
    rt.comm = SimpleNamespace(ranks=ONE, allgather_object=lambda o: seen.append(("all", o)) or [o, o],
                              gather_object=lambda o, root: seen.append(("gather", o, root)) or None,
                              broadcast_object=lambda o, root: seen.append(("bcast", o, root)) or "root's")
    assert rt.allgather_object(1) == [1, 1]
    assert rt.gather_object(2, root=1) is None
    assert rt.broadcast_object(3, root=1) == "root's"
    assert seen == [("all", 1), ("gather", 2, 1), ("bcast", 3, 1)]


def test_a_closed_runtime_refuses_collectives(monkeypatch):
    import nvshmem.core
    import torch

    rt = Runtime(ranks=ONE, ordinal=0, device=None)
    # Its close() with nothing allocated: no GPU here to synchronise, and NVSHMEM was never initialised.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(nvshmem.core, "finalize", lambda: None)
    rt.close()
    for call in (lambda: rt.allgather_object(1), lambda: rt.gather_object(1), lambda: rt.broadcast_object(1)):
        with pytest.raises(ChunkringUsageError, match="closed"):
            call()


def test_a_comm_for_other_ranks_is_refused():
    with pytest.raises(ChunkringUsageError) as info:
        Runtime(ranks=ONE, ordinal=0, device=None, comm=HostComm(RankInfo(1, 2, 1, 2)))
    assert info.value.field == "comm"


def test_collective_constructors_check_arguments_through_the_runtime():
    check_identical(Runtime(ranks=ONE, ordinal=0, device=None), ("spec", 1.0))  # one rank agrees with itself
    agreeing = SimpleNamespace(world_size=2, allgather_object=lambda v: [v, v])
    check_identical(agreeing, ("spec", 1.0))
    disagreeing = SimpleNamespace(world_size=3, allgather_object=lambda v: [v, v, ("spec", 2.0)])
    with pytest.raises(ChunkringUsageError, match=r"ranks disagree .*\{2: \('spec', 2.0\)\}") as info:
        check_identical(disagreeing, ("spec", 1.0))
    assert info.value.field == "spec"


def test_the_workers_host_only_runtime_is_a_host_comm():
    from chunkring_launch.worker import HostRuntime

    rt = HostRuntime(ONE)
    assert isinstance(rt, HostComm) and rt.comm is rt
    assert rt.gather_object({"iterations": 3}, root=0) == [{"iterations": 3}]
    rt.barrier()
    rt.close()


def test_library_and_launcher_reach_mpi_only_through_host_comm():
    """mpi4py is imported by chunkring.hostcomm (HostComm, whose communicator also bootstraps NVSHMEM) and by
    the doctor's check of the mpi4py package; nowhere else in the package, the benchmarks or the scripts."""
    import ast

    from tests.helpers.source_tree import import_statements, module_files

    allowed = {"chunkring.hostcomm", "chunkring_launch.doctor"}
    users = set()
    for name, path in module_files().items():
        for node in import_statements(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "mpi4py" or n.startswith("mpi4py.") for n in names):
                users.add(name)
    assert "chunkring.hostcomm" in users
    assert users <= allowed, sorted(users - allowed)
