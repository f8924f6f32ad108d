"""Bring-up: ``init()``, the one call a process makes - torch's CUDA context first, then NVSHMEM on it - and
``current()``, the :class:`~chunkring.runtime.Runtime` it returned.

``init()`` works under ``mpirun`` (any number of ranks, several of them may share one GPU) and in a plain
single process with no launcher at all. Host-side collectives go through :class:`~chunkring.hostcomm.HostComm`
(``rt.comm``); the runtime's symmetric memory and kernel libraries through :class:`~chunkring.runtime.Runtime`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from chunkring.env import apply_process_defaults
from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError, NoGpuError
from chunkring.hostcomm import HostComm
from chunkring.ranks import RankInfo
from chunkring.runtime import Runtime

if TYPE_CHECKING:  # imported where used: importing chunkring initialises neither torch nor NVSHMEM
    from cuda.core import Device

__all__ = ["current", "init", "ranks_on_my_gpu", "warn_if_time_sliced"]

log = logging.getLogger("chunkring")

_current: Runtime | None = None


def init(rank_info: RankInfo | None = None) -> Runtime:
    """Initialise CUDA and NVSHMEM for this process and return its :class:`Runtime`. A collective over all
    ranks of the job (under ``mpirun``; a plain single process needs no launcher).

    Args:
        rank_info: this process's place in the job (None: :meth:`RankInfo.from_env`, what ``mpirun`` sets). The
            GPU is ``local_rank % device_count``, so several ranks may share one GPU (run them under MPS so
            their kernels run concurrently: ``chunkring-launch --mps``).

    Returns:
        The :class:`Runtime`; ``close()`` it (or use ``with``) at the end.

    Raises:
        NoGpuError: no CUDA device is visible, before NVSHMEM is touched.
        ChunkringUsageError: chunkring is already initialised in this process, or an NVLink multicast variable
            is set to turn multicast on.
        ChunkringRuntimeError: NVSHMEM's initialisation failed, or its PE numbering disagrees with the ranks.
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
                       gpu_ranks=ranks_on_my_gpu(comm, str(device.uuid)), _on_close=_forget)
    if _current.gpu_ranks > 1:
        from chunkring.env import mps_enabled

        warn_if_time_sliced(_current.gpu_ranks, mps_enabled(ordinal))
    return _current


def warn_if_time_sliced(gpu_ranks: int, mps: bool) -> None:
    """Ranks sharing a GPU without MPS each have a context of their own, which the GPU runs in turns: a rank's
    kernels wait for its slice while its peers spin for it. Correct, but a wait for a peer lasts time slices,
    not microseconds."""
    if not mps:
        log.warning("chunkring: %d ranks share this GPU without MPS, so their kernels run in turns, not side by "
                    "side; start an MPS daemon (chunkring-launch --mps) for their kernels to run concurrently",
                    gpu_ranks)


def ranks_on_my_gpu(comm: HostComm, gpu_uuid: str) -> int:
    """How many ranks of the job run on this rank's GPU (itself included): one per GPU in production,
    several on one GPU under MPS. A collective over every rank."""
    import socket

    mine = (socket.gethostname(), gpu_uuid)
    # Unbounded, like the NVSHMEM initialisation just before it (a collective of every rank with no timeout
    # of its own): a rank that never comes is caught by the launcher's --timeout, which ends the job.
    return sum(gpu == mine for gpu in comm.allgather_object(mine))


def _forget(runtime: Runtime) -> None:
    """``Runtime.close``'s callback: a closed runtime is no longer the process's current one."""
    global _current
    if _current is runtime:
        _current = None


def current() -> Runtime:
    """The runtime ``init()`` returned; raises if there is none."""
    if _current is None:
        raise ChunkringUsageError("chunkring is not initialised: call chunkring.init() first")
    return _current


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
