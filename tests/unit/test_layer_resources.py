"""A layer's construction is all or nothing on every rank (chunkring.moe._engine.resources.agree): a step that can fail
on one rank only is run everywhere, then the ranks compare outcomes before any collective allocation, so a rank
never waits in an allocation its peers left - every rank raises, naming each failed rank and why."""

from types import SimpleNamespace

import pytest
import torch

from chunkring import ChunkringRuntimeError, ChunkringUsageError, MoEConfig, PayloadFormat
from chunkring.errors import ChunkringError
from chunkring.moe._engine import resources
from chunkring.moe._engine.resources import LayerResources, agree
from chunkring.ring.transport import Transport


def runtime_seeing(outcomes):
    """A stand-in runtime whose allgather returns ``outcomes`` (every rank's (error name, message) or None)."""
    return SimpleNamespace(allgather_object=lambda mine: outcomes)


def test_a_step_that_succeeds_everywhere_returns():
    ran = []
    agree(runtime_seeing([None, None]), lambda: ran.append(1))
    assert ran == [1]


def test_the_one_rank_that_failed_raises_its_own_error():
    def fail():
        raise ChunkringUsageError("waves > 1 needs DIRECT peers", field="waves")

    with pytest.raises(ChunkringUsageError) as info:
        agree(runtime_seeing([("ChunkringUsageError", "waves: ..."), None]), fail)
    assert info.value.field == "waves"  # unchanged: the rank's own error


def test_a_rank_that_succeeded_raises_when_a_peer_failed():
    peers = [None, ("ChunkringRuntimeError", "the FP8 expert GEMMs need DeepGEMM")]
    with pytest.raises(ChunkringRuntimeError, match=r"rank 1: ChunkringRuntimeError: the FP8 expert GEMMs"):
        agree(runtime_seeing(peers), lambda: None)


def test_usage_errors_everywhere_stay_usage_errors_and_name_every_rank():
    def fail():
        raise ChunkringUsageError("too small to split", field="partition")

    outcomes = [("ChunkringUsageError", "partition: too small"), ("ChunkringUsageError", "partition: too small")]
    with pytest.raises(ChunkringUsageError, match=r"rank 0: .*rank 1: "):
        agree(runtime_seeing(outcomes), fail)
    mixed = [("ChunkringUsageError", "a"), ("RuntimeError", "b")]
    with pytest.raises(ChunkringRuntimeError):
        agree(runtime_seeing(mixed), fail)


# -- construction over stand-ins: which collectives each rank makes when one rank's own allocation fails --------

CONFIG = MoEConfig(num_experts=8, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=16,
                   payload=PayloadFormat.BF16)


class RecordingRing:
    """A ring that records its collective construction and teardown (Ring's are collectives on every rank)."""

    def __init__(self, runtime, spec, *, timeout_s, transport):
        self.runtime, self.transports, self.rma_anywhere = runtime, (Transport.DIRECT,) * 2, False
        runtime.collectives.append("ring")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.runtime.collectives.append("ring destroyed")


def build_at(monkeypatch, rank: int, failing_rank: int) -> tuple[list[str], BaseException]:
    """Construct LayerResources as rank ``rank`` of two, where rank ``failing_rank`` runs out of memory allocating
    its stage (ordinary memory: no peer is reached by RMA); the collectives it made, in order, and its error."""
    failure = ("OutOfMemoryError", "CUDA out of memory")
    peer_outcomes = iter([None, failure if failing_rank != rank else None])  # the peer's, at each agreement

    def allgather_object(mine):
        return [mine, next(peer_outcomes)] if rank == 0 else [next(peer_outcomes), mine]

    runtime = SimpleNamespace(rank=rank, world_size=2, gpu_ranks=1, torch_device=torch.device("cpu"), collectives=[],
                              allgather_object=allgather_object, peer_address=lambda tensor, pe: 0)
    runtime.alloc = lambda shape, dtype: runtime.collectives.append("alloc") or torch.zeros(shape, dtype=dtype)
    runtime.free = lambda tensor: runtime.collectives.append("free")

    def allocate_stage(*args, alloc=None, **kwargs):
        if rank == failing_rank:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return object()

    monkeypatch.setattr(resources, "Ring", RecordingRing)
    monkeypatch.setattr(resources, "Stage", SimpleNamespace(allocate=allocate_stage))
    monkeypatch.setattr(resources, "ExpertCompute", lambda *args, **kwargs: SimpleNamespace(capacity=64))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    kernels = SimpleNamespace(stream=SimpleNamespace(resident_blocks_per_sm=lambda name, block: 4), experts=None)
    with pytest.raises((ChunkringError, torch.OutOfMemoryError)) as info:
        LayerResources(runtime, CONFIG, partition="none", kernels=kernels)
    return runtime.collectives, info.value


def test_a_rank_out_of_memory_in_its_own_buffers_fails_every_rank_through_the_same_collectives(monkeypatch):
    """The rank's own buffers come after its collective allocations, and the ranks agree on them: the rank that ran
    out of memory and the rank that did not raise alike and free their rings and symmetric buffers in the same
    order - neither frees while the other allocates."""
    failed, failed_error = build_at(monkeypatch, rank=1, failing_rank=1)
    peer, peer_error = build_at(monkeypatch, rank=0, failing_rank=1)
    assert failed == peer == ["ring", "alloc", "free", "ring destroyed"]
    assert isinstance(failed_error, torch.OutOfMemoryError)  # its own error, unchanged
    assert isinstance(peer_error, ChunkringRuntimeError) and "rank 1: OutOfMemoryError" in str(peer_error)


def test_auto_falls_back_to_deepgemm_where_the_decode_path_cannot_run():
    """decode="auto" on a GPU or layer the persistent consumer cannot run (not Hopper, the bf16 payload) runs every
    call on DeepGEMM's path; on Hopper with an FP8 layer it stays "auto"."""
    fp8 = MoEConfig(num_experts=8, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=16)
    assert resources.auto_decode(fp8, 2, "sm_90") == "auto"
    assert resources.auto_decode(fp8, 2, "sm_100") is False
    assert resources.auto_decode(CONFIG, 2, "sm_90") is False  # bf16
