"""A stand-in for :class:`chunkring.Runtime` without a GPU, for the ring's lifetime tests on the CPU: symmetric
tensors are CPU tensors, every peer is reached by RMA (no mapped window), host collectives go through a real
:class:`chunkring.hostcomm.HostComm` (one process, or ranks under mpirun), and ``quiesce`` - the GPU half of a
real runtime's (device sync, NVSHMEM quiet) has nothing to wait for here - logs each call and meets the other
ranks at the same bounded barrier a real runtime uses. ``events`` records what the ring asked for, in order."""

from __future__ import annotations

import torch

from chunkring.hostcomm import HostComm


class HostOnlyRuntime:
    def __init__(self, comm: HostComm) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.torch_device = torch.device("cpu")
        self.events: list[tuple] = []
        self.live: dict[int, torch.Tensor] = {}

    def alloc(self, shape, dtype):
        tensor = torch.zeros(shape, dtype=dtype)
        self.live[tensor.data_ptr()] = tensor
        self.events.append(("alloc", tensor.data_ptr()))
        return tensor

    def free(self, tensor):
        del self.live[tensor.data_ptr()]
        self.events.append(("free", tensor.data_ptr()))

    def mapped_host_word(self):
        return torch.zeros(1, dtype=torch.int64), 0  # no device writes it here

    def peer_address(self, tensor, pe):
        return 0  # no mapped window on a CPU: every peer by RMA

    def allgather_object(self, obj, *, timeout_s=None):
        if timeout_s is not None:
            self.comm.barrier(timeout_s, what="an allgather")
        return self.comm.allgather_object(obj)

    def abandon_barrier(self):
        self.events.append(("abandon",))
        self.comm.abandon_barrier()

    def quiesce(self, timeout_s, *, what):
        self.events.append(("quiesce", timeout_s, what))
        self.comm.barrier(timeout_s, what=what)
