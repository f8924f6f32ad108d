"""publish_chunk and gather check every argument before anything is enqueued (no GPU needed)."""

from types import SimpleNamespace

import pytest
import torch

from chunkring.errors import ChunkringUsageError
from chunkring.ring.io import GatherOutputs, gather, publish_chunk
from chunkring.ring.spec import PayloadFormat, RingSpec
from chunkring.ring.transport import Transport
from chunkring.runtime import TEARDOWN_WAIT_S

SPEC = RingSpec(world_size=2, num_slots=2, tokens_per_slot=8, hidden=256, payload=PayloadFormat.FP8_E4M3, topk=4,
                num_experts=8)
# A stand-in ring whose device is the CPU, so the checks run without a GPU: one process, every peer DIRECT.
RING = SimpleNamespace(spec=SPEC, runtime=SimpleNamespace(torch_device=torch.device("cpu"),
                                                          allgather_object=lambda obj: [obj]),
                       transports=(Transport.DIRECT,) * 2, rma_anywhere=False, check_alive=lambda: None)


def good(n=3):
    return dict(x=torch.zeros(n, 256, dtype=torch.float8_e4m3fn), x_sf=torch.zeros(n, 2),
                topk_idx=torch.zeros(n, 4, dtype=torch.int32), topk_weights=torch.zeros(n, 4), token_base=0,
                end_of_stream=True)


@pytest.mark.parametrize("change,field", [
    ({"x": torch.zeros(9, 256, dtype=torch.float8_e4m3fn)}, "x"),
    ({"x": torch.zeros(3, 256, dtype=torch.bfloat16)}, "x"),
    ({"x": torch.zeros(3, 128, dtype=torch.float8_e4m3fn)}, "x"),
    ({"x": torch.zeros(256, dtype=torch.float8_e4m3fn)}, "x"),
    ({"x": torch.zeros(3 * 256 + 1, dtype=torch.float8_e4m3fn)[1:].view(3, 256)}, "x"),  # off a 16-byte boundary
    ({"x_sf": None}, "x_sf"),
    ({"x_sf": torch.zeros(3, 2, dtype=torch.float64)}, "x_sf"),
    ({"topk_idx": torch.zeros(3, 4, dtype=torch.int64)}, "topk_idx"),
    ({"topk_idx": torch.zeros(3, 5, dtype=torch.int32)}, "topk_idx"),
    ({"topk_weights": torch.zeros(4, 3).t()}, "topk_weights"),
    ({"token_base": -1}, "token_base"),
    ({"token_base": 1.0}, "token_base"),
    ({"end_of_stream": 1}, "end_of_stream"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int32)}, "batch_rows"),
    ({"batch_rows": 8}, "valid_tokens"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int64), "batch_rows": 8}, "valid_tokens"),
    ({"valid_tokens": torch.zeros(2, dtype=torch.int32), "batch_rows": 8}, "valid_tokens"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int32), "batch_rows": 2}, "batch_rows"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int32), "batch_rows": True}, "batch_rows"),
])
def test_publish_rejects(change, field):
    with pytest.raises(ChunkringUsageError) as info:
        publish_chunk(RING, **{**good(), **change})
    assert info.value.field == field


def test_empty_chunk_must_end_the_stream():
    with pytest.raises(ChunkringUsageError, match="empty chunk"):
        publish_chunk(RING, **{**good(0), "end_of_stream": False})


def test_gather_rejects_bad_outputs():
    with pytest.raises(ChunkringUsageError) as info:
        gather(RING, object())
    assert info.value.field == "out"
    with pytest.raises(ChunkringUsageError) as info:
        GatherOutputs(RING, -1)
    assert info.value.field == "capacity"
    for grid in (0, 65536, 2.0, True):
        with pytest.raises(ChunkringUsageError) as info:
            gather(RING, GatherOutputs(RING, 4), grid=grid)
        assert info.value.field == "grid"


def test_publish_grid_keeps_small_chunks_on_one_block_and_caps_large_ones():
    """One block (the one-kernel publish) up to PUBLISH_BYTES_PER_BLOCK, one more per that many bytes
    after it, never more than PUBLISH_MAX_BLOCKS: the three-kernel publish only where a copy is large."""
    from chunkring.ring.io import PUBLISH_BYTES_PER_BLOCK as B
    from chunkring.ring.io import PUBLISH_MAX_BLOCKS, publish_grid

    assert [publish_grid(n) for n in (0, 1, B)] == [1, 1, 1]
    assert [publish_grid(n) for n in (B + 1, 2 * B, 2 * B + 1)] == [2, 2, 3]
    assert publish_grid(8192 * 4096) == PUBLISH_MAX_BLOCKS  # the 34 MB FP8 batch of DeepGEMM's shape
    assert publish_grid(256 * 7168) == 4  # one 256-token chunk of hidden 7,168: the GPU test's split shape


class FakeRuntime:
    """Rank 0 of two on the CPU: the peer's part of each all-gather is ``peer``'s answer to it; symmetric
    allocations, frees and host barriers are recorded in ``calls``."""

    def __init__(self, peer):
        self.torch_device = torch.device("cpu")
        self.peer = peer
        self.calls = []

    def allgather_object(self, obj):
        return [obj, self.peer(obj)]

    def alloc(self, shape, dtype):
        tensor = torch.zeros(shape, dtype=dtype)
        self.calls.append(("alloc", tensor.data_ptr(), tuple(shape), dtype))
        return tensor

    def free(self, tensor):
        self.calls.append(("free", tensor.data_ptr()))

    def quiesce(self, timeout_s, *, what):
        self.calls.append(("quiesce", timeout_s, what))


def ring_on(runtime, transports, spec=SPEC, *, peer_rma=False):
    """A ring of ``runtime`` whose PEs this rank reaches by ``transports``; ``peer_rma``: the peer has an RMA PE
    (Ring.rma_anywhere is the ranks' agreed answer)."""
    return SimpleNamespace(spec=spec, runtime=runtime, transports=transports, check_alive=lambda: None,
                           rma_anywhere=Transport.RMA in transports or peer_rma)


ROWS = ("x", "x_sf", "topk_idx", "topk_weights")
DIRECT, RMA = (Transport.DIRECT,) * 2, (Transport.DIRECT, Transport.RMA)


@pytest.mark.parametrize("mine,peers", [(RMA, False), (DIRECT, True), (RMA, True)])
def test_gather_rows_come_from_the_symmetric_heap_where_any_rank_reads_by_rma(mine, peers):
    """docs/PROTOCOL.md, "Transports": the gather's gets land in these rows, and a get's local buffer must be
    NVSHMEM-registered for an off-node peer - which one GPU cannot show (its gets are the threads' own copies
    through a mapping that takes any buffer). A peer's RMA counts too: the allocation is a collective."""
    runtime = FakeRuntime(lambda obj: obj)
    out = GatherOutputs(ring_on(runtime, mine, peer_rma=peers), 4)
    assert out.symmetric
    allocated = {call[1]: call[2:] for call in runtime.calls if call[0] == "alloc"}
    for name in ROWS:
        tensor = getattr(out, name)
        assert allocated.pop(tensor.data_ptr()) == (tuple(tensor.shape), tensor.dtype), name
    assert allocated == {}, "only the rows a get writes are symmetric (counts and arrivals are local stores)"
    runtime.calls.clear()
    out.close()
    assert runtime.calls[0] == ("quiesce", TEARDOWN_WAIT_S, "GatherOutputs.close()")  # bounded, as a ring's destroy
    assert sorted(runtime.calls[1:]) == sorted(("free", getattr(out, name).data_ptr()) for name in ROWS)
    with pytest.raises(ChunkringUsageError) as info:
        gather(ring_on(runtime, mine), out)
    assert info.value.field == "out"
    out.close()  # once only
    assert len(runtime.calls) == 5


def test_gather_rows_stay_device_memory_where_every_peer_is_direct():
    runtime = FakeRuntime(lambda obj: obj)
    out = GatherOutputs(ring_on(runtime, DIRECT), 4)
    assert not out.symmetric and runtime.calls == []
    out.close()  # nothing to free collectively: no barrier either
    assert runtime.calls == []


def test_empty_rows_are_never_symmetric():
    """The heap holds no zero-byte block, and no get reaches one (fetch_block skips zero bytes): bf16
    scales and a zero capacity stay ordinary tensors."""
    bf16 = RingSpec(world_size=2, num_slots=2, tokens_per_slot=8, hidden=256, payload=PayloadFormat.BF16, topk=4,
                    num_experts=8)
    runtime = FakeRuntime(lambda obj: obj)
    out = GatherOutputs(ring_on(runtime, RMA, bf16), 4)
    assert [call[2] for call in runtime.calls] == [(2, 4, 256), (2, 4, 4), (2, 4, 4)] and out.x_sf.numel() == 0
    runtime.calls.clear()
    GatherOutputs(ring_on(runtime, RMA), 0)
    assert runtime.calls == []


def test_every_rank_must_ask_for_the_same_capacity():
    runtime = FakeRuntime(lambda obj: obj + 1)
    with pytest.raises(ChunkringUsageError) as info:
        GatherOutputs(ring_on(runtime, RMA), 4)
    assert info.value.field == "capacity" and runtime.calls == []


def test_a_bad_capacity_on_one_rank_raises_on_every_rank_after_the_same_collective():
    """The bad value travels in the all-gather: the rank that passed it raises after it, as its peers do - none
    raises before the collective while the others wait in it."""
    bad_here = FakeRuntime(lambda obj: 4)
    with pytest.raises(ChunkringUsageError, match="must be a non-negative int") as info:
        GatherOutputs(ring_on(bad_here, RMA), -1)
    assert info.value.field == "capacity" and bad_here.calls == []
    bad_there = FakeRuntime(lambda obj: None)  # the peer passed a bad one
    with pytest.raises(ChunkringUsageError, match=r"rank\(s\) \[1\] passed a capacity") as info:
        GatherOutputs(ring_on(bad_there, RMA), 4)
    assert info.value.field == "capacity" and bad_there.calls == []
