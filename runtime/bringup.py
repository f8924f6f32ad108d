"""Bring-up and teardown: torch's CUDA context first, then NVSHMEM on it; symmetric tensors; explicit close.

``init()`` is the one call a process makes. It works under ``mpirun`` (any number of ranks, several of
them may share one GPU) and in a plain single process with no launcher at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from chunkring.env import apply_process_defaults
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError, NoGpuError
from chunkring.ranks import RankInfo

__all__ = ["Runtime", "init", "current"]

log = logging.getLogger("chunkring")

_current: "Runtime | None" = None


def init(rank_info: RankInfo | None = None) -> "Runtime":
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
    _init_nvshmem(device, ranks)
    _current = Runtime(ranks=ranks, ordinal=ordinal, device=device)
    return _current


def current() -> "Runtime":
    """The runtime ``init()`` returned; raises if there is none."""
    if _current is None:
        raise ChunkringUsageError("chunkring is not initialised: call chunkring.init() first")
    return _current


def _init_nvshmem(device, ranks: RankInfo) -> None:
    import nvshmem.core as nvshmem

    try:
        if ranks.world_size == 1:
            nvshmem.init(device=device, uid=nvshmem.get_unique_id(), rank=0, nranks=1, initializer_method="uid")
        else:
            # Global rank 0 makes the unique id and MPI broadcasts it; every rank then joins by uid.
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            if comm.Get_size() != ranks.world_size or comm.Get_rank() != ranks.rank:
                raise ChunkringUsageError(
                    f"MPI sees rank {comm.Get_rank()}/{comm.Get_size()} but the environment says "
                    f"{ranks.rank}/{ranks.world_size}",
                    field="rank_info",
                )
            nvshmem.init(device=device, mpi_comm=comm, initializer_method="emulated_mpi")
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
    """

    ranks: RankInfo
    ordinal: int
    device: object  # cuda.core.Device
    _tensors: dict = field(default_factory=dict, repr=False)
    _libraries: list = field(default_factory=list, repr=False)
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def torch_device(self):
        import torch

        return torch.device("cuda", self.ordinal)

    def _check_open(self) -> None:
        if self._closed:
            raise ChunkringUsageError("this chunkring Runtime was closed")

    def alloc(self, shape, dtype):
        """A zero-filled symmetric torch tensor. This is a collective: every PE must call it alike."""
        import nvshmem.core as nvshmem
        import torch

        self._check_open()
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(n < 0 for n in shape):
            raise ChunkringUsageError(f"negative dimension in {shape}", field="shape")
        try:
            tensor = nvshmem.tensor(shape, dtype=dtype)
        except (nvshmem.NvshmemError, nvshmem.NvshmemInvalid) as exc:
            raise ChunkringRuntimeError(f"symmetric allocation of {shape} {dtype} failed: {exc}") from exc
        tensor.zero_()
        torch.cuda.current_stream().synchronize()
        self._tensors[tensor.data_ptr()] = tensor
        return tensor

    def free(self, tensor) -> None:
        """Return a tensor made by :meth:`alloc`. A collective, like the allocation."""
        import nvshmem.core as nvshmem

        self._check_open()
        if self._tensors.pop(tensor.data_ptr(), None) is None:
            raise ChunkringUsageError("tensor was not allocated by this Runtime (or was freed already)")
        nvshmem.free_tensor(tensor)

    def peer(self, tensor, pe: int):
        """A view of ``tensor``'s counterpart on ``pe``, for PEs reachable by load/store (same node)."""
        import nvshmem.core as nvshmem

        self._check_open()
        if not 0 <= pe < self.world_size:
            raise ChunkringUsageError(f"PE {pe} outside world of {self.world_size}", field="pe")
        return nvshmem.get_peer_tensor(tensor, pe)

    def barrier(self) -> None:
        """Host-side barrier over all PEs on torch's current stream, then wait for it."""
        import nvshmem.core as nvshmem
        import torch

        self._check_open()
        stream = torch.cuda.current_stream()
        nvshmem.barrier_all(stream=stream)
        stream.synchronize()

    def load(self, object_code):
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

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
