"""A layer fails closed (issue 30), shown on the CPU with a real :class:`MoELayer` over host-only rings:

* once a ring's kernels recorded an error - here written as ``record_error`` writes it on the device: the status
  record, and the abort word of the error into the ring's pinned failure word - the next call of every entry
  point raises the typed error ``check()`` raises (the rank, the cause; the origin rank for a peer's abort),
  before anything of the call is enqueued: ``MoELayer.run`` and ``forward``, the ``chunkring::moe_run`` and
  ``chunkring::moe_forward`` operators, ``MoEModule`` and the transformers drop-in; after a reset calls go on;
* the drop-in reaches the layer through the ``chunkring::moe_run`` operator (the operator's look-up of the
  layer's handle sees every call);
* a bad argument of this rank's own in a collective call aborts the ring that call would wait in (one
  ``ring_raise_abort`` launch with ``HOST_USAGE``), then raises the usage error; a bad ``streaming`` mode, a
  destroyed layer and a check inside a graph capture abort nothing.

What the host-only rings stand in for: the ring's buffer and kernels. Their ``check()`` and ``raise_if_failed()``
are :class:`chunkring.Ring`'s, through the same public functions (:func:`status_error`,
:func:`raise_recorded_failure`), with a counter for the device synchronisation. tests/gpu/test_fail_closed.py
records the errors on a GPU instead.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import chunkring.moe._engine.call
import chunkring.moe.layer
import chunkring.moe.op
from chunkring import MoELayer
from chunkring.errors import ChunkringPeerAbortedError, ChunkringTimeoutError, ChunkringUsageError
from chunkring.moe import CallMode
from chunkring.ring.status import AbortRecord, ErrorCode, Site
from tests.helpers.host_layer import (
    ENTRY_POINTS,
    EPOCH,
    INTER,
    E,
    H,
    K,
    Launches,
    N,
    config,
    entry_points,
    host_layer,
    record_launches,
    routed,
    weights,
)


@pytest.fixture
def launches(monkeypatch) -> Launches:
    return record_launches(monkeypatch)



@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_raises_a_recorded_device_error_on_the_next_call(monkeypatch, entry):
    layer = host_layer(monkeypatch, config())
    call = entry_points(layer)[entry]
    call()
    assert layer.schedule.calls == 1
    for ring in layer.rings.values():  # a peer's abort stops a wait of one ring, this rank's own error the other
        assert ring.synchronized == 0  # nothing recorded: one host read, no synchronisation
    streamed, batch_ready = layer.rings[CallMode.STREAMED], layer.rings[CallMode.BATCH_READY]
    streamed.record(ErrorCode.TIMEOUT, Site.WAIT_ROUTE, peer=0)
    with pytest.raises(ChunkringTimeoutError, match="PE 0: TIMEOUT while waiting for source 0's route") as info:
        call()
    assert "streamed ring" in "\n".join(info.value.__notes__) and streamed.synchronized == 1
    assert layer.schedule.calls == 1  # raised before the call was handed on
    with pytest.raises(ChunkringTimeoutError):  # and again, until a reset
        call()
    streamed.reset()
    peer_abort = AbortRecord.make(EPOCH, 3, ErrorCode.STALE_EPOCH).word
    batch_ready.record(ErrorCode.PEER_ABORTED, Site.WAIT_PUSHED, abort=peer_abort)
    with pytest.raises(ChunkringPeerAbortedError, match="rank 3 recorded STALE_EPOCH") as aborted:
        call()
    assert aborted.value.origin_rank == 3 and aborted.value.code == ErrorCode.STALE_EPOCH
    batch_ready.reset()
    call()
    assert layer.schedule.calls == 2


def test_the_drop_in_raises_a_recorded_error_through_the_operator(monkeypatch):
    pytest.importorskip("transformers")
    from chunkring.integrations.transformers import ChunkringMoEBlock, plan_moe_blocks
    from chunkring.testing.hf_models import tiny_model

    model = tiny_model("qwen3_moe")
    (block, cfg), *_ = plan_moe_blocks(model, world_size=1, max_tokens_per_rank=N, payload="bf16")
    assert (cfg.num_experts, cfg.hidden) == (E, H)
    layer = host_layer(monkeypatch, cfg)
    drop_in = ChunkringMoEBlock(block, layer)
    looked_up = []
    real_lookup = chunkring.moe.op.layer_for_handle
    monkeypatch.setattr(chunkring.moe.op, "layer_for_handle",
                        lambda handle: looked_up.append(handle) or real_lookup(handle))
    hidden = torch.randn(1, 3, H).to(torch.bfloat16)
    with torch.no_grad():
        assert drop_in(hidden).shape == hidden.shape
        assert looked_up == [layer.handle] and layer.schedule.calls == 1  # the operator called the layer
        layer.rings[CallMode.BATCH_READY].record(ErrorCode.GENERATION_AHEAD, Site.WAIT_ROUTE)
        with pytest.raises(chunkring.errors.ChunkringDeviceError, match="PE 0: GENERATION_AHEAD"):
            drop_in(hidden)
    assert looked_up == [layer.handle] * 2 and layer.schedule.calls == 1


BAD_ARGUMENTS = {
    "topk_idx": dict(topk_idx=torch.zeros(5, K, dtype=torch.int64)),
    "x": dict(x=torch.zeros(N + 1, H, dtype=torch.bfloat16)),
    "out": dict(out=torch.zeros(4, H, dtype=torch.bfloat16)),
    "chunk": dict(chunk=9),  # past the 8-token slot
    # a view one element in: the GEMMs load 16 bytes at a time
    "w13": dict(w13=torch.zeros(E * 2 * INTER * H + 1, dtype=torch.bfloat16)[1:].view(E, 2 * INTER, H)),
}


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("field", BAD_ARGUMENTS)
def test_a_bad_argument_of_this_ranks_own_aborts_the_ring_its_peers_wait_in(monkeypatch, launches, field, streaming):
    layer = host_layer(monkeypatch, config(), rank=2)
    layer.schedule.warm.update(CallMode)  # the peers wait on the device, for this rank's chunks
    gen = torch.Generator().manual_seed(1)
    _, w13, w2 = weights(gen)
    args = {**routed(gen), "w13": w13, "w2": w2, "streaming": streaming, **BAD_ARGUMENTS[field]}
    # chunk=9 on a batch-ready call too: the call ignores chunk's size but not its range (call_chunk)
    with pytest.raises(ChunkringUsageError) as info:
        layer.run(**args)
    assert info.value.field == field
    ring = layer.rings[CallMode.STREAMED if args["streaming"] else CallMode.BATCH_READY]
    assert launches.calls == [("ring_raise_abort", {"desc": ring.desc, "code": int(ErrorCode.HOST_USAGE)})]
    assert layer.schedule.calls == 0
    assert layer.runtime.abandoned == 0


def test_at_a_modes_first_call_a_failed_entry_abandons_the_warm_up_barrier_instead(monkeypatch, launches):
    """Before a mode's first call no peer has a kernel on its ring: they wait at the warm-up barrier, on the
    host. This rank tells them it will not come - for a bad argument and for a recorded error alike - and leaves
    the ring unpoisoned."""
    layer = host_layer(monkeypatch, config())
    gen = torch.Generator().manual_seed(5)
    _, w13, w2 = weights(gen)
    batch = {**routed(gen), "w13": w13, "w2": w2}
    layer.schedule.warm.add(CallMode.BATCH_READY)
    with pytest.raises(ChunkringUsageError):
        layer.run(**{**batch, **BAD_ARGUMENTS["topk_idx"]}, streaming=True)  # streamed: cold
    assert layer.runtime.abandoned == 1 and launches.calls == []
    layer.rings[CallMode.STREAMED].record(ErrorCode.TIMEOUT, Site.WAIT_ROUTE)
    with pytest.raises(ChunkringTimeoutError):
        layer.run(**batch, streaming=True)
    assert layer.runtime.abandoned == 2 and launches.calls == []
    # Batch-ready, warm: its peers wait on the device, and the streamed ring's error aborted only that ring, so this
    # call's ring is aborted too (on the device, a no-op where this rank's record is taken already).
    with pytest.raises(ChunkringTimeoutError):
        layer.run(**batch)
    ring = layer.rings[CallMode.BATCH_READY]
    assert layer.runtime.abandoned == 2
    assert launches.calls == [("ring_raise_abort", {"desc": ring.desc, "code": int(ErrorCode.HOST_USAGE)})]


def test_forward_aborts_on_a_bad_argument_too(monkeypatch, launches):
    layer = host_layer(monkeypatch, config())
    layer.schedule.warm.update(CallMode)
    router, w13, w2 = weights(torch.Generator().manual_seed(2))
    with pytest.raises(ChunkringUsageError, match="router_weight"):
        layer.forward(torch.zeros(5, H, dtype=torch.bfloat16), router[:, :128], w13, w2)
    assert [name for name, *_ in launches.calls] == ["ring_raise_abort"]


def test_a_misaligned_router_weight_is_refused_before_the_router_kernel_would_trap(monkeypatch, launches):
    """The router GEMM loads the router's bf16 pairs as 4-byte words: a view at a 2-byte offset (contiguous, the
    right shape) would be a misaligned-address trap that kills the process's CUDA context. Refused at the entry,
    naming the field (and, on a warm layer, the ring aborted like any bad argument of this rank's own)."""
    layer = host_layer(monkeypatch, config())
    layer.schedule.warm.update(CallMode)
    router, w13, w2 = weights(torch.Generator().manual_seed(6))
    shifted = torch.zeros(E * H + 1, dtype=torch.bfloat16)[1:].view(E, H)
    shifted.copy_(router)
    assert shifted.is_contiguous() and shifted.data_ptr() % 4
    with pytest.raises(ChunkringUsageError) as info:
        layer.forward(torch.zeros(5, H, dtype=torch.bfloat16), shifted, w13, w2)
    assert info.value.field == "router_weight" and "16-byte boundary" in str(info.value)
    assert layer.schedule.calls == 0 and [name for name, *_ in launches.calls] == ["ring_raise_abort"]


def test_what_every_rank_fails_alike_aborts_nothing(monkeypatch, launches):
    layer = host_layer(monkeypatch, config(streaming=False))
    gen = torch.Generator().manual_seed(3)
    _, w13, w2 = weights(gen)
    batch = {**routed(gen), "w13": w13, "w2": w2}
    for streaming in ("sometimes", True):  # not a mode; a mode this layer has no ring for
        with pytest.raises(ChunkringUsageError) as info:
            layer.run(**batch, streaming=streaming)
        assert info.value.field == "streaming"
    layer.close()
    with pytest.raises(ChunkringUsageError, match="closed"):
        layer.run(**batch)
    assert launches.calls == []


def test_a_check_inside_a_graph_capture_aborts_nothing(monkeypatch, launches):
    layer = host_layer(monkeypatch, config())
    layer.schedule.warm.update(CallMode)
    monkeypatch.setattr(chunkring.moe.layer, "capturing", lambda: True)
    _, w13, w2 = weights(torch.Generator().manual_seed(4))
    with pytest.raises(ChunkringUsageError):
        layer.run(**BAD_ARGUMENTS["topk_idx"], x=torch.zeros(5, H, dtype=torch.bfloat16), x_sf=None,
                  topk_weights=torch.zeros(5, K), w13=w13, w2=w2)
    assert launches.calls == []


def test_a_layer_reset_zeroes_its_arrival_counts_after_every_rings_reset(monkeypatch):
    """A failed call may leave an arrival count short of its last block, which would never publish or acknowledge
    again: MoELayer.reset zeroes the layer's counts, after its rings' resets (their quiesce: no kernel of the failed
    call still arrives). Calls themselves do not zero the producer's count."""
    layer = host_layer(monkeypatch, config(streaming=True))
    layer.reset()
    assert layer.runtime.resets == ["ring", "ring", "counts"]


def test_a_rank_whose_own_check_fails_abandons_the_layers_first_barrier(monkeypatch):
    """The environment (lazy module loading) may differ between ranks: a rank whose own check of it fails before
    the layer's first collective tells its peers it will not come, so they raise at once. An argument check fails
    alike on every rank given the same arguments, and abandons nothing."""
    monkeypatch.setattr(chunkring.moe.layer, "module_loading_is_eager", lambda: False)
    runtime = SimpleNamespace(rank=1, world_size=2, torch_device=torch.device("cpu"), abandoned=0,
                              allgather_object=lambda value: pytest.fail("the failed rank came to the barrier"))
    runtime.abandon_barrier = lambda: setattr(runtime, "abandoned", runtime.abandoned + 1)
    with pytest.raises(ChunkringUsageError) as info:
        MoELayer(runtime, config())
    assert info.value.field == "CUDA_MODULE_LOADING" and runtime.abandoned == 1
    with pytest.raises(ChunkringUsageError) as info:
        MoELayer(runtime, config(), decode="sometimes")
    assert info.value.field == "decode" and runtime.abandoned == 1


def test_run_publishes_a_misaligned_batch_from_an_aligned_copy(monkeypatch):
    """A view of x at an odd offset is legal input: run() copies it once, as forward() does, since the publish
    copies rows 16 bytes at a time."""
    layer = host_layer(monkeypatch, config())
    published = []
    monkeypatch.setattr(chunkring.moe._engine.call, "enqueue_publish", lambda ring, x, *args: published.append(x))

    def enqueue(call):
        call.batch.publish(layer.rings[call.mode], 0, call.n, True, None, None, None, False)
        return torch.zeros(call.n, H, dtype=torch.bfloat16)

    layer.schedule.enqueue = enqueue
    gen = torch.Generator().manual_seed(4)
    _, w13, w2 = weights(gen)
    batch = routed(gen)
    x = torch.zeros(5 * H + 1, dtype=torch.bfloat16)[1:].view(5, H)
    x.copy_(batch.pop("x"))
    layer.run(x=x, **batch, w13=w13, w2=w2)
    assert x.data_ptr() % 16 and published[0].data_ptr() % 16 == 0 and torch.equal(published[0], x)
