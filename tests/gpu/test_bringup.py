"""Bring-up on the GPU: symmetric tensors line up across PEs, and the NVSHMEM self-test kernels
(signal_op, signal_wait_until, atomic_or, putmem) move checked data between every pair of neighbours.
Runs with 1 rank or under `mpirun -np N` (several ranks may share one GPU under MPS)."""

import pytest
import torch

from chunkring.errors import ChunkringUsageError
from chunkring_launch.jobs import bringup

pytestmark = pytest.mark.gpu


def test_symmetric_tensor_is_visible_at_every_peer(runtime):
    mine = runtime.alloc((4, 8), torch.int32)
    mine.fill_(runtime.rank + 1)
    runtime.barrier()
    for pe in range(runtime.world_size):
        peer = runtime.peer(mine, pe)
        assert peer.shape == mine.shape
        assert torch.all(peer == pe + 1), f"PE {pe}'s tensor seen from PE {runtime.rank}"
    runtime.barrier()
    runtime.free(mine)


def test_ring_pass_and_acks(runtime):
    figures = bringup.run(runtime, bringup.CONFIG(rounds=4, words_per_pe=1 << 15, pingpong_iters=200))
    assert figures["ring_pass_rounds"] == 4
    if runtime.world_size >= 2 and runtime.rank == 0:
        assert figures["pingpong_rtt_us"] > 0


def test_launch_rejects_bad_arguments_before_enqueueing(runtime):
    from chunkring.jit import library_for

    lib = library_for(runtime, "selftest")
    wrong = torch.zeros(4, dtype=torch.float32, device=runtime.torch_device)
    with pytest.raises(ChunkringUsageError, match="expected dtype"):
        lib.launch("selftest_pingpong", signal=wrong, peer=0, iters=1, initiator=1, elapsed_ns=wrong)
    with pytest.raises(ChunkringUsageError, match=r"missing \['peer', 'iters', 'initiator', 'elapsed_ns'\]"):
        lib.launch("selftest_pingpong", signal=wrong)
    with pytest.raises(ChunkringUsageError, match=r"unknown \['iterations'\]"):
        lib.launch("selftest_pingpong", signal=wrong, peer=0, iterations=1, iters=1, initiator=1, elapsed_ns=wrong)
    with pytest.raises(TypeError):
        lib.launch("selftest_pingpong", wrong, 0, 1, 1, wrong)  # positional arguments are not accepted


def test_free_twice_is_refused(runtime):
    t = runtime.alloc(16, torch.int64)
    runtime.free(t)
    with pytest.raises(ChunkringUsageError):
        runtime.free(t)


@pytest.mark.parametrize("shape", [0, (4, 0), (0, 3, 2)])
def test_an_empty_symmetric_tensor_is_refused_before_nvshmem(runtime, shape):
    with pytest.raises(ChunkringUsageError, match="at least one element"):
        runtime.alloc(shape, torch.float32)


def test_init_counts_the_ranks_sharing_this_gpu(runtime):
    """``Runtime.gpu_ranks``: every rank whose GPU has this one's UUID on this host (all of them on a host
    with one GPU), the same count on each of them."""
    uuids = runtime.allgather_object(str(runtime.device.uuid))
    assert runtime.gpu_ranks == uuids.count(str(runtime.device.uuid))
    if torch.cuda.device_count() == 1:
        assert runtime.gpu_ranks == runtime.world_size
