"""Host-side collectives of a job: :class:`HostComm`, small picklable Python objects over every rank.

Under ``mpirun`` they run over MPI's world communicator (mpi4py, imported at the first collective); in a
single process they are trivial and MPI is never initialised. No GPU is involved: the :class:`~chunkring.Runtime`
owns one (``rt.comm``), and code that runs without a GPU makes its own (``HostComm.from_env()``). Library
code never talks to MPI directly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypeVar

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.ranks import RankInfo

if TYPE_CHECKING:  # imported at the first collective: a single process never initialises MPI
    from mpi4py import MPI

__all__ = ["HostComm"]

T = TypeVar("T")


class HostComm:
    """Host-side collectives over every rank of the job, on small picklable Python objects.

    Under ``mpirun`` they run over MPI's world communicator (mpi4py, imported and checked against
    ``ranks`` at the first collective); in a single process (``world_size == 1``) they are trivial and
    MPI is never initialised. No GPU is involved, so this also serves jobs and tests without one.

    Each method is a collective: every rank calls the same ones in the same order (with the same
    ``root``). Under MPI what a rank receives is a pickled copy (in a single process, the object
    itself): do not rely on identity, or on mutating what you received.
    """

    def __init__(self, ranks: RankInfo):
        if not isinstance(ranks, RankInfo):
            raise ChunkringUsageError(f"expected a RankInfo, got {type(ranks).__name__}", field="ranks")
        self.ranks = ranks
        self._comm: Any = None  # mpi4py's COMM_WORLD, once checked
        self._late: list[Any] = []  # barriers that timed out here (barrier), matched when the absent ranks come

    @classmethod
    def from_env(cls) -> HostComm:
        """The collectives of this process's job as its launcher describes it (:meth:`RankInfo.from_env`)."""
        return cls(RankInfo.from_env())

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def __repr__(self) -> str:
        return f"HostComm(rank {self.rank} of {self.world_size})"

    def _mpi(self) -> MPI.Intracomm:
        """mpi4py's world communicator, after checking that MPI sees this process as ``ranks`` does."""
        if self._comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            if comm.Get_size() != self.world_size or comm.Get_rank() != self.rank:
                raise ChunkringUsageError(
                    f"MPI sees rank {comm.Get_rank()}/{comm.Get_size()} but the environment says "
                    f"{self.rank}/{self.world_size}",
                    field="rank_info",
                )
            self._comm = comm
        return self._comm

    def _check_root(self, root: int) -> None:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ChunkringUsageError(f"root {root!r} outside world of {self.world_size}", field="root")

    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        return self._mpi().allgather(obj)

    def gather_object(self, obj: T, root: int = 0) -> list[T] | None:
        """Every rank's ``obj`` in rank order on ``root``; ``None`` on the other ranks."""
        self._check_root(root)
        if self.world_size == 1:
            return [obj]
        return self._mpi().gather(obj, root=root)

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        """``root``'s ``obj`` on every rank (what the other ranks pass is ignored; ``None`` will do)."""
        self._check_root(root)
        if self.world_size == 1:
            return obj
        return self._mpi().bcast(obj, root=root)

    def barrier(self, timeout_s: float | None = None) -> None:
        """Return once every rank has called it. Host only: it orders no GPU work. With ``timeout_s``, raise
        :class:`ChunkringRuntimeError` once that many seconds pass with some rank absent (one that raised
        before it, say) instead of waiting for ever; a rank that comes later still matches this barrier, so
        the ranks' later collectives stay in step."""
        if self.world_size == 1:
            return
        if timeout_s is None:
            self._mpi().Barrier()
            return
        request = self._mpi().Ibarrier()
        deadline = time.monotonic() + timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                self._late.append(request)  # completed when the absent ranks come; kept, not leaked
                raise ChunkringRuntimeError(f"rank {self.rank}: not every rank reached the barrier within "
                                            f"{timeout_s:g} s (a rank that raised before it never comes)")
            time.sleep(0.001)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (``MPI_Abort``), so none waits in a collective for this one.
        Does nothing in a single process (the caller returns or exits as it would anyway)."""
        if self.world_size > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)  # unchecked: an abort must work whatever went wrong
