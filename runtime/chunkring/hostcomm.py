"""Host-side collectives of a job: :class:`HostComm`, small picklable Python objects over every rank.

Under ``mpirun`` they run over MPI's world communicator (mpi4py, imported at the first collective); in a
single process they are trivial and MPI is never initialised. No GPU is involved: the :class:`~chunkring.Runtime`
owns one (``rt.comm``), and code that runs without a GPU makes its own (``HostComm.from_env()``). Library
code never talks to MPI directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from chunkring.errors import ChunkringUsageError
from chunkring.ranks import InJob, RankInfo
from chunkring.rollcall import Message, RollCall

if TYPE_CHECKING:  # imported at the first collective: a single process never initialises MPI
    from mpi4py import MPI

__all__ = ["HostComm"]

T = TypeVar("T")


class HostComm(InJob):
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

    @classmethod
    def from_env(cls) -> HostComm:
        """The collectives of this process's job as its launcher describes it (:meth:`RankInfo.from_env`)."""
        return cls(RankInfo.from_env())

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

    def barrier(self, timeout_s: float | None = None, *, what: str = "a barrier") -> None:
        """Return once every rank has called it. Host only: it orders no GPU work. With ``timeout_s``, raise
        :class:`~chunkring.errors.ChunkringHostTimeoutError` naming the absent ranks once that many seconds
        pass without them, instead of waiting for ever (:class:`~chunkring.rollcall.RollCall`: a rank that
        comes after its peers gave up raises too, naming them; ``what`` names the wait in the error). Without
        it, MPI's own barrier: for callers that a supervisor bounds (the launcher's ``--timeout``)."""
        if self.world_size == 1:
            return
        if timeout_s is None:
            self._mpi().Barrier()
            return
        _world_roll_call(self._mpi()).meet(timeout_s, what)

    def abandon_barrier(self) -> None:
        """Tell every rank that this one will not come to its next bounded :meth:`barrier` (it failed before it):
        the others raise at once, naming it (:meth:`~chunkring.rollcall.RollCall.abandon`)."""
        if self.world_size > 1:
            _world_roll_call(self._mpi()).abandon()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (``MPI_Abort``), so none waits in a collective for this one.
        Does nothing in a single process (the caller returns or exits as it would anyway)."""
        if self.world_size > 1:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)  # unchecked: an abort must work whatever went wrong


#: The point-to-point tag of roll-call messages: nothing else of ours sends point-to-point on the world
#: communicator (collectives travel in a context of their own, so they never match it).
ROLL_CALL_TAG = 0x5243


_roll_call: RollCall | None = None


def _world_roll_call(comm: MPI.Intracomm) -> RollCall:
    """The process's one roll call over the world communicator, whatever HostComm asks: its barriers are
    numbered in the process's order of calls, as the communicator's collectives are, and a second instance
    would take the first one's messages for its own."""
    global _roll_call
    if _roll_call is None:
        _roll_call = RollCall(comm.Get_rank(), comm.Get_size(), _MpiMailbox(comm))
    return _roll_call


class _MpiMailbox:
    """A roll call's messages over MPI point-to-point (small pickled tuples; a send never blocks)."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self._sends: list[Any] = []  # requests still in flight, tested and dropped once complete

    def post(self, dest: int, message: Message) -> None:
        self._sends = [request for request in self._sends if not request.Test()]
        self._sends.append(self.comm.isend(message, dest=dest, tag=ROLL_CALL_TAG))

    def arrived(self) -> Iterator[tuple[int, Message]]:
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=ROLL_CALL_TAG, status=status):
            source = status.Get_source()
            yield source, self.comm.recv(source=source, tag=ROLL_CALL_TAG)
