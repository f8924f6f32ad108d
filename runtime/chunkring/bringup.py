"""Bring-up and teardown: torch's CUDA context first, then NVSHMEM on it; symmetric tensors; explicit close.

``init()`` is the one call a process makes. It works under ``mpirun`` (any number of ranks, several of
them may share one GPU) and in a plain single process with no launcher at all.

Host-side collectives (gather, broadcast, barrier of small Python objects) go through one
:class:`HostComm`, which needs no GPU: the :class:`Runtime` owns one (``rt.comm``) and offers its
collectives as methods; code that runs without a GPU makes its own (``HostComm.from_env()``). Library
code never talks to MPI directly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from chunkring.env import apply_process_defaults
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError, NoGpuError
from chunkring.ranks import RankInfo

if TYPE_CHECKING:  # imported where used: importing chunkring initialises neither torch nor NVSHMEM
    import torch
    from cuda.core import Device, ObjectCode
    from mpi4py import MPI
    from nvshmem.core import NvshmemKernelObject

__all__ = ["HostComm", "Runtime", "init", "current"]

T = TypeVar("T")

log = logging.getLogger("chunkring")

_current: Runtime | None = None


def init(rank_info: RankInfo | None = None) -> Runtime:
    """Initialise CUDA and NVSHMEM for this process and return its :class:`Runtime`.

    This is a collective over all ranks of the job. The GPU is chosen as ``local_rank % device_count``,
    so several ranks may share one GPU (run them under MPS so their kernels run concurrently).
    Raises ``NoGpuError`` when no CUDA device is visible, before touching NVSHMEM.
    """
    global _current
    if _current is not None:
        raise ChunkringUsageError("chunkring is already initialised in this process; close() it first")
    ranks = rank_info or RankInfo.from_env()
    apply_process_defaults(single_node=ranks.single_node)

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise NoGpuError("no CUDA GPU is visible to this process (torch.cuda.device_count() == 0)")
    ordinal = ranks.local_rank % torch.cuda.device_count()
    # torch creates and owns the primary context; NVSHMEM binds to the context current at its init,
    # so torch must come first or the two would disagree about which context the heap lives in.
    torch.cuda.set_device(ordinal)
    torch.cuda.init()
    torch.empty(1, device=f"cuda:{ordinal}")

    from cuda.core import Device

    device = Device(ordinal)
    device.set_current()
    comm = HostComm(ranks)
    _init_nvshmem(device, comm)
    _current = Runtime(ranks=ranks, ordinal=ordinal, device=device, comm=comm,
                       gpu_ranks=_ranks_on_my_gpu(comm, str(device.uuid)))
    if _current.gpu_ranks > 1:
        from chunkring.env import mps_enabled

        _warn_if_time_sliced(_current.gpu_ranks, mps_enabled(ordinal))
    return _current


def _warn_if_time_sliced(gpu_ranks: int, mps: bool) -> None:
    """Ranks sharing a GPU without MPS each have a context of their own, which the GPU runs in turns: a rank's
    kernels wait for its slice while its peers spin for it. Correct, but a wait for a peer lasts time slices,
    not microseconds."""
    if not mps:
        log.warning("chunkring: %d ranks share this GPU without MPS, so their kernels run in turns, not side by "
                    "side; start an MPS daemon (chunkring-launch --mps) for their kernels to run concurrently",
                    gpu_ranks)


def _ranks_on_my_gpu(comm: HostComm, gpu_uuid: str) -> int:
    """How many ranks of the job run on this rank's GPU (itself included): one per GPU in production,
    several on one GPU under MPS. A collective over every rank."""
    import socket

    mine = (socket.gethostname(), gpu_uuid)
    return sum(gpu == mine for gpu in comm.allgather_object(mine))


def current() -> Runtime:
    """The runtime ``init()`` returned; raises if there is none."""
    if _current is None:
        raise ChunkringUsageError("chunkring is not initialised: call chunkring.init() first")
    return _current


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


def _init_nvshmem(device: Device, comm: HostComm) -> None:
    import nvshmem.core as nvshmem

    ranks = comm.ranks
    try:
        if ranks.world_size == 1:
            nvshmem.init(device=device, uid=nvshmem.get_unique_id(), rank=0, nranks=1, initializer_method="uid")
        else:
            # Global rank 0 makes the unique id and MPI broadcasts it; every rank then joins by uid.
            nvshmem.init(device=device, mpi_comm=comm._mpi(), initializer_method="emulated_mpi")
    except (nvshmem.NvshmemError, nvshmem.NvshmemInvalid) as exc:
        raise ChunkringRuntimeError(f"NVSHMEM initialisation failed on rank {ranks.rank}: {exc}") from exc
    if nvshmem.my_pe() != ranks.rank or nvshmem.n_pes() != ranks.world_size:
        raise ChunkringRuntimeError(
            f"NVSHMEM PE {nvshmem.my_pe()}/{nvshmem.n_pes()} does not match rank {ranks.rank}/{ranks.world_size}"
        )


@dataclass(eq=False)
class Runtime:
    """One process's CUDA device and NVSHMEM membership. Close it explicitly (or use ``with``).

    Symmetric tensors made by :meth:`alloc` have the same offset in every PE's heap; all of them are
    freed by :meth:`close` before NVSHMEM finalises, as NVSHMEM requires.

    Host-side collectives over the same ranks: :meth:`allgather_object`, :meth:`gather_object`,
    :meth:`broadcast_object` (through ``comm``, a :class:`HostComm`, made from ``ranks`` if not given)
    and :meth:`barrier` (NVSHMEM's, ordered with the GPU work of torch's current stream).
    """

    ranks: RankInfo
    ordinal: int
    device: Device  # cuda.core
    comm: HostComm | None = field(default=None, repr=False)
    #: Ranks of the job on this rank's GPU, this one included (``init()`` counts them). Under MPS their kernels
    #: run side by side on its SMs, so the grids that spin are sized to this rank's share of them.
    gpu_ranks: int = 1
    _tensors: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _libraries: list[NvshmemKernelObject] = field(default_factory=list, repr=False)
    _closed: bool = False

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = HostComm(self.ranks)
        elif self.comm.ranks != self.ranks:
            raise ChunkringUsageError(f"comm is for {self.comm.ranks}, the runtime for {self.ranks}", field="comm")
        if not 1 <= self.gpu_ranks <= self.world_size:
            raise ChunkringUsageError(f"must be in [1, world_size={self.world_size}], got {self.gpu_ranks}",
                                      field="gpu_ranks")

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.ordinal)

    def _check_open(self) -> None:
        if self._closed:
            raise ChunkringUsageError("this chunkring Runtime was closed")

    @property
    def _host(self) -> HostComm:
        """``comm``, never None once constructed (``__post_init__`` makes one)."""
        assert self.comm is not None
        return self.comm

    def alloc(self, shape: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled symmetric torch tensor. This is a collective: every PE must call it alike."""
        import nvshmem.core as nvshmem
        import torch

        self._check_open()
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(n < 0 for n in shape):
            raise ChunkringUsageError(f"negative dimension in {shape}", field="shape")
        if math.prod(shape) == 0:  # NVSHMEM allocates no zero-byte block
            raise ChunkringUsageError(f"a symmetric tensor needs at least one element, got shape {shape}",
                                      field="shape")
        try:
            tensor = nvshmem.tensor(shape, dtype=dtype)
        except (nvshmem.NvshmemError, nvshmem.NvshmemInvalid) as exc:
            raise ChunkringRuntimeError(f"symmetric allocation of {shape} {dtype} failed: {exc}") from exc
        tensor.zero_()
        torch.cuda.current_stream().synchronize()
        self._tensors[tensor.data_ptr()] = tensor
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Return a tensor made by :meth:`alloc`. A collective, like the allocation."""
        import nvshmem.core as nvshmem

        self._check_open()
        if self._tensors.pop(tensor.data_ptr(), None) is None:
            raise ChunkringUsageError("tensor was not allocated by this Runtime (or was freed already)")
        nvshmem.free_tensor(tensor)

    def peer(self, tensor: torch.Tensor, pe: int) -> torch.Tensor:
        """A view of ``tensor``'s counterpart on ``pe``, for PEs reachable by load/store (same node)."""
        import nvshmem.core as nvshmem

        self._check_open()
        if not 0 <= pe < self.world_size:
            raise ChunkringUsageError(f"PE {pe} outside world of {self.world_size}", field="pe")
        return nvshmem.get_peer_tensor(tensor, pe)

    def peer_address(self, tensor: torch.Tensor, pe: int) -> int:
        """The host's ``nvshmem_ptr``: the address at which this GPU reaches ``tensor``'s counterpart on
        ``pe`` with loads and stores, or 0 when NVSHMEM maps no such window (a peer over the network)."""
        from nvshmem.bindings import ptr

        self._check_open()
        if not 0 <= pe < self.world_size:
            raise ChunkringUsageError(f"PE {pe} outside world of {self.world_size}", field="pe")
        return int(ptr(tensor.data_ptr(), pe) or 0)

    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (small, picklable), in rank order, on every rank. A collective on the host
        (:meth:`HostComm.allgather_object`); trivial in a single process."""
        self._check_open()
        return self._host.allgather_object(obj)

    def gather_object(self, obj: T, root: int = 0) -> list[T] | None:
        """Every rank's ``obj`` in rank order on ``root``, ``None`` elsewhere. A collective on the host
        (:meth:`HostComm.gather_object`)."""
        self._check_open()
        return self._host.gather_object(obj, root)

    def broadcast_object(self, obj: T, root: int = 0) -> T:
        """``root``'s ``obj`` on every rank. A collective on the host (:meth:`HostComm.broadcast_object`)."""
        self._check_open()
        return self._host.broadcast_object(obj, root)

    def host_barrier(self, timeout_s: float | None = None) -> None:
        """Return once every rank has called it (:meth:`HostComm.barrier`, ``timeout_s`` as there). Host only:
        it orders no GPU work and enqueues nothing, so it may run while a stream is being captured."""
        self._host.barrier(timeout_s)

    def barrier(self) -> None:
        """Host-side barrier over all PEs on torch's current stream (NVSHMEM's), then wait for it. A
        collective; unlike :meth:`HostComm.barrier` it is ordered with the stream's GPU work."""
        import nvshmem.core as nvshmem
        import torch

        self._check_open()
        stream = torch.cuda.current_stream()
        nvshmem.barrier_all(stream=stream)
        stream.synchronize()

    def load(self, object_code: ObjectCode) -> NvshmemKernelObject:
        """Register a compiled kernel library with NVSHMEM (once per process per library)."""
        import nvshmem.core as nvshmem

        self._check_open()
        library = nvshmem.NvshmemKernelObject.from_obj(object_code)
        try:
            nvshmem.library_init(library)
        except (nvshmem.NvshmemError, nvshmem.NvshmemInvalid) as exc:
            raise ChunkringRuntimeError(f"NVSHMEM could not initialise the kernel library: {exc}") from exc
        self._libraries.append(library)
        return library

    def close(self) -> None:
        """Free every symmetric tensor and kernel library, then finalise NVSHMEM. A collective."""
        global _current
        if self._closed:
            return
        import nvshmem.core as nvshmem
        import torch

        torch.cuda.synchronize(self.ordinal)
        for tensor in self._tensors.values():
            nvshmem.free_tensor(tensor)
        self._tensors.clear()
        for library in self._libraries:
            nvshmem.library_finalize(library)
        self._libraries.clear()
        nvshmem.finalize()
        self._closed = True
        if _current is self:
            _current = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
