"""One process's CUDA device and NVSHMEM membership: :class:`Runtime` (symmetric tensors, kernel libraries,
host collectives through its :class:`~chunkring.hostcomm.HostComm`, explicit close).

``chunkring.init()`` (:mod:`chunkring.bringup`) makes the one a process uses; this module imports neither
torch nor NVSHMEM until a method needs them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError, ChunkringWedgedError
from chunkring.hostcomm import HostComm
from chunkring.ranks import InJob, RankInfo
from chunkring.rollcall import abandoning_on_failure

if TYPE_CHECKING:  # imported where used: importing chunkring initialises neither torch nor NVSHMEM
    import torch
    from cuda.core import Device, ObjectCode
    from nvshmem.core import NvshmemKernelObject

__all__ = ["PEER_WAIT_S", "TEARDOWN_WAIT_S", "Runtime"]

log = logging.getLogger("chunkring")

T = TypeVar("T")

#: How long :meth:`Runtime.barrier` waits for every rank by default before it raises, naming the absent ones:
#: far above any legitimate skew between ranks (a peer's first kernel builds take minutes), yet finite.
PEER_WAIT_S = 900.0
#: How long a teardown (a ring's or a layer's close, GatherOutputs.close) waits for every rank by default before
#: it raises with nothing freed, instead of hanging in the collective frees.
TEARDOWN_WAIT_S = 300.0


@dataclass(eq=False)
class Runtime(InJob):
    """One process's CUDA device and NVSHMEM membership. Close it explicitly (or use ``with``).

    Symmetric tensors made by :meth:`alloc` have the same offset in every PE's heap; all of them are
    freed by :meth:`close` before NVSHMEM finalises, as NVSHMEM requires.

    Host-side collectives over the same ranks: :meth:`allgather_object`, :meth:`gather_object`,
    :meth:`broadcast_object` (through ``comm``, a :class:`HostComm`, made from ``ranks`` if not given),
    :meth:`host_barrier`, and the bounded waits that also settle the GPU: :meth:`barrier` (torch's current
    stream) and :meth:`quiesce` (the whole device, before symmetric memory is zeroed or freed).
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
    _before_close: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _closed: bool = False
    #: A wait for the device timed out (a kernel never ended): close() then touches nothing.
    _wedged: bool = field(default=False, repr=False)
    #: Called with this runtime once it is closed (``init()`` forgets it as the process's current one).
    _on_close: Callable[[Runtime], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = HostComm(self.ranks)
        elif self.comm.ranks != self.ranks:
            raise ChunkringUsageError(f"comm is for {self.comm.ranks}, the runtime for {self.ranks}", field="comm")
        if not 1 <= self.gpu_ranks <= self.world_size:
            raise ChunkringUsageError(f"must be in [1, world_size={self.world_size}], got {self.gpu_ranks}",
                                      field="gpu_ranks")

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

    def alloc(self, shape: int | Sequence[int], dtype: torch.dtype, *,
              timeout_s: float | None = PEER_WAIT_S) -> torch.Tensor:
        """A zero-filled symmetric torch tensor. This is a collective: every PE must call it alike. NVSHMEM's
        allocation waits for every PE with no limit of its own, so a bounded roll call comes first
        (:meth:`_roll_call`)."""
        import nvshmem.core as nvshmem
        import torch

        self._check_open()
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(n < 0 for n in shape):
            raise ChunkringUsageError(f"negative dimension in {shape}", field="shape")
        if math.prod(shape) == 0:  # NVSHMEM allocates no zero-byte block
            raise ChunkringUsageError(f"a symmetric tensor needs at least one element, got shape {shape}",
                                      field="shape")
        self._roll_call(timeout_s, "a symmetric allocation")
        try:
            tensor = nvshmem.tensor(shape, dtype=dtype)
        except (nvshmem.NvshmemError, nvshmem.NvshmemInvalid) as exc:
            raise ChunkringRuntimeError(f"symmetric allocation of {shape} {dtype} failed: {exc}") from exc
        tensor.zero_()
        torch.cuda.current_stream().synchronize()
        self._tensors[tensor.data_ptr()] = tensor
        return tensor

    def free(self, tensor: torch.Tensor, *, timeout_s: float | None = PEER_WAIT_S) -> None:
        """Return a tensor made by :meth:`alloc`. A collective, like the allocation (bounded alike). It does not
        wait for kernels that may still use the memory: :meth:`quiesce` first (as every chunkring object does)."""
        import nvshmem.core as nvshmem

        self._check_open()
        if tensor.data_ptr() not in self._tensors:
            raise ChunkringUsageError("tensor was not allocated by this Runtime (or was freed already)")
        self._roll_call(timeout_s, "a symmetric free")
        del self._tensors[tensor.data_ptr()]
        nvshmem.free_tensor(tensor)

    def mapped_host_word(self) -> tuple[torch.Tensor, int]:
        """One zeroed int64 in pinned host memory, and its address in this GPU's address space: a word the device
        writes and the host reads with a plain load, without synchronising (a ring's failure word)."""
        import torch
        from cuda.bindings import runtime as cudart

        host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        err, address = cudart.cudaHostGetDevicePointer(host.data_ptr(), 0)
        if err != cudart.cudaError_t.cudaSuccess:
            raise ChunkringRuntimeError(f"pinned host memory is not mapped into the GPU's address space: {err}")
        return host, int(address)

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

    def allgather_object(self, obj: T, *, timeout_s: float | None = PEER_WAIT_S) -> list[T]:
        """Every rank's ``obj`` (small, picklable), in rank order, on every rank. A collective on the host
        (:meth:`HostComm.allgather_object`); trivial in a single process. Bounded as :meth:`_roll_call` says."""
        self._roll_call(timeout_s, "an allgather")
        return self._host.allgather_object(obj)

    def gather_object(self, obj: T, root: int = 0, *, timeout_s: float | None = PEER_WAIT_S) -> list[T] | None:
        """Every rank's ``obj`` in rank order on ``root``, ``None`` elsewhere. A collective on the host
        (:meth:`HostComm.gather_object`), bounded as :meth:`_roll_call` says."""
        self._roll_call(timeout_s, "a gather")
        return self._host.gather_object(obj, root)

    def broadcast_object(self, obj: T, root: int = 0, *, timeout_s: float | None = PEER_WAIT_S) -> T:
        """``root``'s ``obj`` on every rank. A collective on the host (:meth:`HostComm.broadcast_object`),
        bounded as :meth:`_roll_call` says."""
        self._roll_call(timeout_s, "a broadcast")
        return self._host.broadcast_object(obj, root)

    def _roll_call(self, timeout_s: float | None, what: str) -> None:
        """Before an MPI collective, which has no timeout of its own: a bounded barrier, so a rank that never
        comes makes the others raise (naming it) instead of waiting in the collective for ever; once every rank
        has answered it, every rank is at the collective, which then completes. ``timeout_s=None``: no roll call
        (a caller that a supervisor bounds)."""
        self._check_open()
        if timeout_s is not None and self.world_size > 1:
            self._host.barrier(timeout_s, what=what)

    def host_barrier(self, timeout_s: float | None = None, *, what: str = "a barrier") -> None:
        """Return once every rank has called it (:meth:`HostComm.barrier`, ``timeout_s`` and ``what`` as there).
        Host only: it orders no GPU work and enqueues nothing, so it may run while a stream is being captured."""
        self._host.barrier(timeout_s, what=what)

    def abandon_barrier(self) -> None:
        """This rank will not come to the next bounded barrier (:meth:`host_barrier`, or a collective's roll call):
        the ranks waiting there raise at once, naming it (:meth:`HostComm.abandon_barrier`)."""
        self._host.abandon_barrier()

    def barrier(self, timeout_s: float = PEER_WAIT_S, *, what: str = "a barrier") -> None:
        """Every rank's work on torch's current stream, its NVSHMEM operations included, is complete when this
        returns on any rank. A collective: complete this PE's outstanding NVSHMEM operations in the stream's
        order (``nvshmemx_quiet_on_stream``), wait for the stream, then meet every rank at a host barrier
        bounded by ``timeout_s`` (:class:`~chunkring.errors.ChunkringHostTimeoutError` naming the absent ranks;
        NVSHMEM's own ``barrier_all`` would wait for ever for a rank that never comes)."""
        import torch

        self._check_open()
        with abandoning_on_failure(self):
            self._quiet(torch.cuda.current_stream(self.ordinal), timeout_s, what)
        self._host.barrier(timeout_s, what=what)

    def quiesce(self, timeout_s: float, *, what: str) -> None:
        """No kernel of any rank runs, and none of this job's NVSHMEM operations is outstanding, when this
        returns on any rank: the rule before symmetric memory is zeroed (a ring's reset) or freed. A collective:
        wait for every kernel of this device, complete the NVSHMEM operations they issued (a quiet after them:
        a kernel's end completes its stores, not its PE's outstanding RMA), then meet every rank at a host
        barrier bounded by ``timeout_s``; a rank that does not come makes the others raise
        :class:`~chunkring.errors.ChunkringHostTimeoutError` naming it, with nothing after the wait done."""

        self._check_open()
        with abandoning_on_failure(self):
            self.synchronize(timeout_s, what=what)
        self.barrier(timeout_s, what=what)

    def synchronize(self, timeout_s: float, *, what: str) -> None:
        """Wait for every kernel of this device, for at most ``timeout_s``: a kernel that never ends (one whose
        remote operation a dead peer never answers) makes this raise ``ChunkringRuntimeError`` instead of
        blocking the host for ever, as ``torch.cuda.synchronize`` alone would."""
        import torch

        self._device_wait(timeout_s, f"this rank's kernels to end before {what}",
                          lambda: torch.cuda.synchronize(self.ordinal))

    def _quiet(self, stream: torch.cuda.Stream, timeout_s: float, what: str) -> None:
        """Complete this PE's outstanding NVSHMEM operations after ``stream``'s work, then wait for it (bounded)."""
        import nvshmem.core as nvshmem

        nvshmem.quiet(stream=stream)
        self._device_wait(timeout_s, f"this rank's NVSHMEM operations to complete before {what}", stream.synchronize)

    def _device_wait(self, timeout_s: float, what: str, wait: Callable[[], None]) -> None:
        """:func:`_within`; a wait that times out leaves this runtime wedged (:meth:`close` touches nothing)."""
        try:
            _within(timeout_s, what, wait)
        except ChunkringWedgedError:
            self._wedged = True
            raise

    def symmetric_usage(self) -> tuple[int, int]:
        """(tensors, bytes) of this runtime's live symmetric allocations (:meth:`alloc` minus :meth:`free`):
        what its objects hold in NVSHMEM's heap at this rank, to check that create/destroy cycles leak none."""
        return len(self._tensors), sum(t.numel() * t.element_size() for t in self._tensors.values())

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

    def at_close(self, release: Callable[[], None]) -> None:
        """Call ``release`` when this runtime closes, before any symmetric tensor is freed (latest first): what
        lives as long as the runtime, such as :meth:`chunkring.SmPartition.shared`'s partitions."""
        self._check_open()
        self._before_close.append(release)

    def close(self) -> None:
        """Run what :meth:`at_close` registered (the shared SM partitions' destroy), free every symmetric
        tensor and kernel library, then finalise NVSHMEM. A collective. A runtime whose device never went idle
        (:meth:`synchronize` timed out: a kernel still waits on a dead peer) is only marked closed: each step
        here would wait on that kernel for ever; the process's end reclaims it all."""
        if self._closed:
            return
        if self._wedged:
            log.error("chunkring: closing a runtime whose kernels never ended: nothing freed, NVSHMEM not "
                      "finalised (end the job)")
            self._closed = True
            return
        import nvshmem.core as nvshmem
        import torch

        for release in reversed(self._before_close):
            release()
        self._before_close.clear()
        torch.cuda.synchronize(self.ordinal)
        for tensor in self._tensors.values():
            nvshmem.free_tensor(tensor)
        self._tensors.clear()
        for library in self._libraries:
            nvshmem.library_finalize(library)
        self._libraries.clear()
        nvshmem.finalize()
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _within(timeout_s: float, what: str, wait: Callable[[], None]) -> None:
    """Run the blocking ``wait`` (a CUDA synchronisation, which takes no limit) on a helper thread and give it
    ``timeout_s``: past that, raise ``ChunkringRuntimeError`` and leave the thread blocked (a daemon: it does
    not hold the process). Whatever ``wait`` raises is raised here."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="chunkring-bounded-wait", daemon=True).start()
    if not done.wait(timeout_s):
        raise ChunkringWedgedError(f"waited {timeout_s:g} s for {what}: a kernel that never ends (a peer that never "
                                   "answers its remote operation?); end the job")
    if failure:
        raise failure[0]
